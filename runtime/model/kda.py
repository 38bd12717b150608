"""KDA (Kimi delta attention) linear-attention layers of glm5-next (GLM-5.3-Flash).

As llama.cpp (``src/models/glm5-next.cpp`` ``build_kda_layer``) and transformers
(``Glm5NextTextLinearAttention``) compute it, for a normed input ``x [T, D]``:

1. ``q, k, v = Wq x, Wk x, Wv x`` (``d_inner = H·Dk`` each), then a short causal depthwise
   conv of width ``d_conv`` over each channel, continued from the layer's conv window (the
   last ``d_conv - 1`` inputs), then SiLU;
2. ``q, k`` L2-normed per head (``x / sqrt(Σx² + 1e-6)``, FLA's form), ``q`` scaled by
   ``1/sqrt(Dk)``;
3. per-channel log-decay ``g = lb · sigmoid(exp(A_log)[h] · (Wf_b Wf_a x + dt_bias))`` with
   ``lb = gate_lower_bound`` (or ``-exp(A_log)[h] · softplus(·)`` without one); the file holds
   ``ssm_a = -exp(A_log)``; ``beta = sigmoid(Wbeta x)`` per head;
4. the gated delta rule per head over the state ``S [Dk, Dv]``:
   ``S ← diag(exp g_t) S;  S ← S + k_t βt (v_t - Sᵀk_t)ᵀ;  o_t = Sᵀ q_t``
   (``delta_rule_step`` one token at a time, ``delta_rule_chunked`` the same in chunks);
5. ``o = RMSNorm(o) · ssm_norm`` per head, times ``sigmoid(Wg_b Wg_a x)``; ``Wo``. One token:
   native calls (``conv_step_``, ``kda_token_``) where the kernels apply.
Conv windows and ``S``: float32 in ``KDAState`` (``layer_bytes``: llama.cpp's ``n_embd_r +
n_embd_s`` floats per layer). T=tokens, D=embedding, H=heads, Dk=Dv=head dim, C=chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F

from .. import kernels as native
from .rope import rms_norm
from .weights import Linear, RawTensor

__all__ = ["KDA_TENSORS", "KDAConfig", "KDAWeights", "KDAState", "kda_attention",
           "short_conv", "decay_gate", "l2_norm", "delta_rule_step", "delta_rule_chunked",
           "stack_rows"]

# field -> GGUF tensor name after ``blk.{i}.`` (llama.cpp's glm5-next names); torch-order shapes
KDA_TENSORS: dict[str, str] = {
    "wq": "attn_q.weight",            # [H·Dk, D]
    "wk": "attn_k.weight",            # [H·Dk, D]
    "wv": "attn_v.weight",            # [H·Dk, D]
    "q_conv": "ssm_conv1d_q.weight",  # [1, H·Dk, 1, d_conv] (4-D; 3-D [H·Dk, 1, d_conv] accepted)
    "k_conv": "ssm_conv1d_k.weight",
    "v_conv": "ssm_conv1d_v.weight",
    "f_a": "ssm_f_a.weight",          # [Dk, D]
    "f_b": "ssm_f_b.weight",          # [H·Dk, Dk]
    "beta": "ssm_beta.weight",        # [H, D]
    "a": "ssm_a",                     # [H] F32, -exp(A_log), no .weight suffix
    "dt_bias": "ssm_dt.bias",         # [H·Dk] F32
    "g_a": "ssm_g_a.weight",          # [Dk, D]
    "g_b": "ssm_g_b.weight",          # [H·Dk, Dk]
    "o_norm": "ssm_norm.weight",      # [Dk]
    "wo": "attn_output.weight",       # [D, H·Dk]
}
_MATRICES = ("wq", "wk", "wv", "f_a", "f_b", "beta", "g_a", "g_b", "wo")
_L2_EPS = 1e-6
_MAX_SPAN = 80.0   # in-chunk log-decay span factored through exp(±span): finite in float32 for unit k


@dataclass(frozen=True)
class KDAConfig:
    n_head: int                       # {arch}.attention.head_count
    head_dim: int                     # {arch}.kda.head_dim
    d_conv: int                       # {arch}.ssm.conv_kernel
    lower_bound: float | None = -5.0  # {arch}.kda.gate_lower_bound; None: softplus gate
    rms_eps: float = 1e-5             # {arch}.attention.layer_norm_rms_epsilon
    chunk: int = 16                   # prefill chunk: 15·|lower_bound| ≤ _MAX_SPAN keeps the fast form

    @property
    def d_inner(self) -> int:
        return self.n_head * self.head_dim

    @classmethod
    def from_gguf(cls, kv: Mapping[str, object], arch: str = "glm5-next",
                  chunk: int = 16) -> KDAConfig:
        """From GGUF metadata (key → value); a missing lower bound means the softplus gate."""
        lb = kv.get(f"{arch}.kda.gate_lower_bound")
        return cls(n_head=int(kv[f"{arch}.attention.head_count"]),
                   head_dim=int(kv[f"{arch}.kda.head_dim"]),
                   d_conv=int(kv[f"{arch}.ssm.conv_kernel"]),
                   lower_bound=None if lb is None else float(lb),
                   rms_eps=float(kv[f"{arch}.attention.layer_norm_rms_epsilon"]),
                   chunk=chunk)


@dataclass
class KDAWeights:
    """One KDA layer; the matrices are ``Linear`` (float or ggml bytes), the rest float32.

    A loader builds the matrices with ``Linear.load`` and the rest with ``to_float(float32)``
    (``ssm_a``, ``ssm_dt.bias`` and the conv weights are F32 in real files)."""

    wq: Linear
    wk: Linear
    wv: Linear
    q_conv: torch.Tensor              # [H·Dk, d_conv]
    k_conv: torch.Tensor
    v_conv: torch.Tensor
    f_a: Linear
    f_b: Linear
    beta: Linear
    a: torch.Tensor                   # [H] = -exp(A_log)
    dt_bias: torch.Tensor             # [H·Dk]
    g_a: Linear
    g_b: Linear
    o_norm: torch.Tensor              # [Dk]
    wo: Linear
    conv: torch.Tensor = field(init=False, repr=False)   # [3·H·Dk, d_conv], q | k | v
    # fused products (built here; None where they do not apply): float q|k|v in one matrix,
    # f_a|g_a|beta in one (float or ggml bytes), f_b and g_b as one native call for a token
    qkv: Linear | None = field(init=False, repr=False, default=None)
    w_a: Linear | None = field(init=False, repr=False, default=None)
    b_rows: list[torch.Tensor] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        convs = [c.float().reshape(-1, c.shape[-1]) for c in (self.q_conv, self.k_conv, self.v_conv)]
        self.q_conv, self.k_conv, self.v_conv = convs
        self.conv = torch.cat(convs, dim=0).contiguous()
        self.a = self.a.float().reshape(-1)
        self.dt_bias = self.dt_bias.float().reshape(-1)
        self.o_norm = self.o_norm.float().contiguous()
        if all(m.weight is not None for m in (self.wq, self.wk, self.wv)):
            self.qkv = stack_rows([self.wq, self.wk, self.wv])
        self.w_a = stack_rows([self.f_a, self.g_a, self.beta])
        fb, gb = self.f_b.q, self.g_b.q
        if (fb is not None and gb is not None and self.f_b.fused and fb.ggml_type == gb.ggml_type
                and fb.shape == gb.shape and fb.ggml_type in native.TYPES
                and fb.raw.is_cpu and gb.raw.is_cpu):
            self.b_rows = [fb.raw.reshape(-1), gb.raw.reshape(-1)]

    @classmethod
    def from_tensors(cls, t: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                     prefix: str = "") -> KDAWeights:
        """From float tensors keyed ``prefix + KDA_TENSORS[field]`` (e.g. ``prefix="blk.0."``)."""
        args = {}
        for name, gguf in KDA_TENSORS.items():
            x = t[prefix + gguf]
            if name in _MATRICES:
                x = x.to(dtype).contiguous()
                args[name] = Linear(x, None, None, tuple(x.shape))
            else:
                args[name] = x
        return cls(**args)


class KDAState:
    """Per-layer float32 conv windows ``[3·H·Dk, d_conv - 1]`` and delta-rule states
    ``[H, Dk, Dv]`` of one sequence."""

    def __init__(self, cfg: KDAConfig, layers: Iterable[int],
                 device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.layers = tuple(layers)
        self.conv = {il: torch.zeros(3 * cfg.d_inner, cfg.d_conv - 1, device=device)
                     for il in self.layers}
        self.ssm = {il: torch.zeros(cfg.n_head, cfg.head_dim, cfg.head_dim, device=device)
                    for il in self.layers}

    @staticmethod
    def layer_bytes(cfg: KDAConfig) -> int:
        """Bytes per KDA layer: conv windows plus recurrent state, float32, any context."""
        return 4 * (3 * (cfg.d_conv - 1) * cfg.d_inner + cfg.n_head * cfg.head_dim * cfg.head_dim)

    @property
    def nbytes(self) -> int:
        return len(self.layers) * self.layer_bytes(self.cfg)

    def reset(self) -> None:
        for t in (*self.conv.values(), *self.ssm.values()):
            t.zero_()

    def snapshot(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        return ({il: t.clone() for il, t in self.conv.items()},
                {il: t.clone() for il, t in self.ssm.items()})

    def restore(self, snap: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]) -> None:
        for il in self.layers:
            self.conv[il].copy_(snap[0][il])
            self.ssm[il].copy_(snap[1][il])


def short_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + SiLU (one token: native): ``x [T, C]``, ``weight [C, d_conv]``,
    ``window [C, d_conv-1]`` (updated in place to the last ``d_conv - 1`` inputs) → ``[T, C]``."""
    T, K = x.shape[0], weight.shape[1]
    if T == 1 and (y := native.conv_step_(x.float().contiguous(), weight, window)) is not None:
        return y
    xx = torch.cat((window, x.float().t()), dim=1)                    # [C, K - 1 + T]
    y = (xx * weight).sum(-1, keepdim=True) if T == 1 else F.conv1d(    # [C, T]
        xx[None], weight[:, None, :], groups=weight.shape[0])[0]
    if K > 1:
        window.copy_(xx[:, -(K - 1):])
    return F.silu(y).t()


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def stack_rows(ls: list[Linear]) -> Linear | None:
    """One ``Linear`` over the rows of ``ls`` (one input width, no biases): float weights
    concatenated (``ls`` then hold views of it, so no memory is added), or ggml bytes of one
    type concatenated (a copy: meant for small matrices); None when they differ otherwise."""
    cols = {m.in_features for m in ls}
    if len(cols) != 1 or any(m.bias is not None for m in ls):
        return None
    shape = (sum(m.out_features for m in ls), cols.pop())
    if all(m.weight is not None for m in ls):
        if len({(m.weight.dtype, m.weight.device) for m in ls}) != 1:
            return None
        W = torch.cat([m.weight for m in ls])
        a = 0
        for m in ls:
            m.weight, a = W[a:a + m.out_features], a + m.out_features
        out = Linear(W, None, None, shape)
    elif all(m.q is not None for m in ls) and len({(m.q.ggml_type, m.q.raw.device)
                                                     for m in ls}) == 1:
        raw = torch.cat([m.q.raw.reshape(-1) for m in ls])
        out = Linear(None, RawTensor("|".join(m.q.name for m in ls), raw, ls[0].q.ggml_type,
                                     shape), None, shape)
    else:
        return None
    out.fused = ls[0].fused
    return out


def _projections(x: torch.Tensor, w: KDAWeights) -> tuple[torch.Tensor, ...]:
    """``x [T, D]`` → float32 ``q|k|v [T, 3·H·Dk]`` (before the conv), the decay's and the
    output gate's pre-activations ``f``, ``gate [T, H·Dk]`` and beta's ``[T, H]``."""
    qkv = w.qkv(x) if w.qkv is not None else torch.cat((w.wq(x), w.wk(x), w.wv(x)), dim=-1)
    if w.w_a is not None:
        fa, ga, b = w.w_a(x).split((w.f_a.out_features, w.g_a.out_features,
                                    w.beta.out_features), dim=-1)
    else:
        fa, ga, b = w.f_a(x), w.g_a(x), w.beta(x)
    fg = None if x.shape[0] != 1 or w.b_rows is None else native.moe_down_rows(  # both in one
        torch.cat((fa, ga)).float(), w.b_rows, w.f_b.q.ggml_type, w.f_b.out_features,
        w.f_b.act_quant)
    f, gate = (fg[:1], fg[1:]) if fg is not None else (w.f_b(fa), w.g_b(ga))
    return qkv.float(), f.float(), gate.float(), b.float()


def decay_gate(x: torch.Tensor, w: KDAWeights, cfg: KDAConfig) -> torch.Tensor:
    """Per-channel log-decay ``g [T, H, Dk]`` (float32, ≤ 0)."""
    return _log_decay(w.f_b(w.f_a(x)).float(), w, cfg)


def _log_decay(f: torch.Tensor, w: KDAWeights, cfg: KDAConfig) -> torch.Tensor:
    """``g`` from the gate's pre-activation ``f = Wf_b Wf_a x [T, H·Dk]`` (float32)."""
    f = (f + w.dt_bias).view(f.shape[0], cfg.n_head, cfg.head_dim)
    a = w.a.view(1, cfg.n_head, 1)                                     # -exp(A_log)
    if cfg.lower_bound is not None:
        return cfg.lower_bound * torch.sigmoid(-a * f)
    return a * F.softplus(f)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, S: torch.Tensor,
                    inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule: ``q, k, g [T, H, Dk]``, ``v [T, H, Dv]``, ``beta [T, H]``,
    ``S [H, Dk, Dv]`` → ``(o [T, H, Dv], S)``; q already scaled; ``inplace`` updates ``S``.

    Per token, with ``e = exp g``: ``kv = (k⊙e)ᵀS``, ``δ = β (v - kv)``, ``o = (q⊙e)ᵀS + (q·k) δ``,
    ``S ← e ⊙ S + k δᵀ``; one token in one native call (S read and written once), else torch
    ops (one read of S for both products, one in-place update)."""
    S = S if inplace else S.clone()
    o = native.kda_step_(*(t[0].contiguous() for t in (q, k, v, g, beta)), S) if len(q) == 1 else None
    if o is not None:
        return o[None], S
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        e = g[t].exp()                                                  # [H, Dk]
        r = torch.bmm(torch.stack((k[t] * e, q[t] * e), dim=1), S)      # [H, 2, Dv]
        d = (v[t] - r[:, 0]) * beta[t][:, None]                         # [H, Dv]
        out[t] = r[:, 1] + (q[t] * k[t]).sum(-1, keepdim=True) * d
        S.mul_(e[..., None]).baddbmm_(k[t][:, :, None], d[:, None, :])
    return out, S


#: chunks whose intra-chunk terms are formed in one batch (bounds the temporaries' size)
CHUNK_GROUP = 32


def _blocks(x: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """``[T, H, *]`` → ``[n, H, chunk, *]``, zero-padded at the end to ``n·chunk`` tokens."""
    pad = n * chunk - x.shape[0]
    if pad:
        x = torch.cat((x, x.new_zeros((pad, *x.shape[1:]))))
    return x.view(n, chunk, *x.shape[1:]).transpose(1, 2).contiguous()


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """``(I + L)⁻¹`` for strictly lower triangular ``L [..., C, C]``: ``L`` is nilpotent, so the
    inverse is the finite series ``Σ (-L)^j = (I - L)(I + L²)(I + L⁴)…`` (a few batched
    products instead of a triangular solve per matrix)."""
    C = L.shape[-1]
    N = -L
    P = N + torch.eye(C, dtype=L.dtype, device=L.device)
    span = 2
    while span < C:
        N = N @ N
        P = P + P @ N
        span *= 2
    return P


def _intra(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor,
           beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The terms of ``n`` chunks that do not depend on the state, for ``[n, H, C, *]`` inputs
    (``G`` the cumulative log-decay): ``u = M⁻¹ β v``, ``wq = [M⁻¹ β (k⊙Γ) ; q⊙Γ]``,
    ``tril(A_qk)``, ``kd = k ⊙ Γ_last/Γ`` and ``Γ_last``. Every decay is taken from
    ``e = exp(G - G_0)`` (in ``[exp(-span), 1]``, so ``1/e`` stays finite in the factored form)."""
    n, H, C, _ = q.shape
    G0 = G[:, :, :1]
    e = (G - G0).exp()
    e0 = G0.exp()                                                  # [n, H, 1, Dk]
    kr = k / e                                                     # k ⊙ exp(G_0 - G)
    ke, qe = k * e, q * e
    A_kk, A_qk = ke @ kr.transpose(2, 3), qe @ kr.transpose(2, 3)   # [n, H, C, C]
    spans = (G0 - G[:, :, -1:]).amax(dim=(1, 2, 3))              # per chunk, ≥ 0
    big = (spans > _MAX_SPAN).nonzero()[:, 0].tolist()           # one host sync
    if big:                       # exp would overflow: the decays themselves (all ≤ 1)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        for i in big:
            dec = (G[i, :, :, None, :] - G[i, :, None, :, :]).masked_fill(
                ~causal[None, :, :, None], float("-inf")).exp()
            A_kk[i] = torch.einsum("htd,hsd,htsd->hts", k[i], k[i], dec)
            A_qk[i] = torch.einsum("htd,hsd,htsd->hts", q[i], k[i], dec)
        G_last = G[:, :, -1:]
        kd, eG = k * (G_last - G).exp(), G.exp()
    else:
        kd, eG = kr * e[:, :, -1:], None
    Dv = v.shape[-1]
    kg, qg = (ke * e0, qe * e0) if eG is None else (k * eG, q * eG)   # ⊙ Γ = exp G
    sol = _unit_lower_inverse((A_kk * beta[..., None]).tril_(-1)) @ (
        beta[..., None] * torch.cat((v, kg), dim=-1))
    return (sol[..., :Dv], torch.cat((sol[..., Dv:], qg), dim=2), A_qk.tril(), kd,
            (G[:, :, -1:]).exp())


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, S: torch.Tensor,
                       chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence in chunks of ``chunk`` tokens (the last one zero-padded: a padded
    token has no key, value, decay or beta, so it changes nothing).

    Within a chunk, with ``G`` the cumulative log-decay and ``Γ = exp G``: the deltas are
    ``δ = u - w S`` with ``u = M⁻¹ β v``, ``w = M⁻¹ β (k⊙Γ)``, ``M = I + tril₋₁(β ⊙ A_kk)``;
    ``o = (q⊙Γ) S + tril(A_qk) δ``, ``S ← Γ_last ⊙ S + (k ⊙ Γ_last/Γ)ᵀ δ``, where
    ``A_xk[t, s] = Σ_d x_td k_sd exp(G_td - G_sd)``. Everything but the state's passage from
    chunk to chunk is formed for ``CHUNK_GROUP`` chunks at once; ``A`` is a product of
    matrices ``x⊙exp(G - G_0)`` and ``k⊙exp(G_0 - G)`` when the chunk's decay span keeps
    ``exp`` finite (``_MAX_SPAN``), else it is formed from the decays themselves (all ≤ 1), so
    no chunk overflows. Each chunk's step is two batched products and two fused ones.
    """
    T, C = q.shape[0], chunk
    n = -(-T // C)
    blocks = [_blocks(x, n, C) for x in (q, k, v, g)]
    bb = _blocks(beta[..., None], n, C)[..., 0]                       # [n, H, C]
    outs = []
    for a in range(0, n, CHUNK_GROUP):
        b = min(n, a + CHUNK_GROUP)
        qb, kb, vb, gb = (x[a:b] for x in blocks)
        u, wq, A_qk, kd, dl = _intra(qb, kb, vb, gb.cumsum(2), bb[a:b])
        kdt, dl = kd.transpose(2, 3), dl.transpose(2, 3)              # [n, H, Dk, C], [n, H, Dk, 1]
        for i in range(b - a):
            r = wq[i] @ S                                             # [H, 2C, Dv]
            delta = u[i] - r[:, :C]
            outs.append(torch.baddbmm(r[:, C:], A_qk[i], delta))
            S = (S * dl[i]).baddbmm_(kdt[i], delta)
    o = torch.stack(outs).transpose(1, 2).reshape(n * C, *v.shape[1:])
    return o[:T], S


def kda_attention(x: torch.Tensor, w: KDAWeights, cfg: KDAConfig, state: KDAState, layer: int,
                  *, recurrent: bool | None = None) -> torch.Tensor:
    """``x [T, D]`` (attn-normed) → ``[T, D]`` in ``x.dtype``; advances ``state`` by T tokens.

    ``recurrent``: token-by-token recurrence (default for T = 1) or chunked (default T > 1)."""
    T, H, Dk = x.shape[0], cfg.n_head, cfg.head_dim
    qkv, f, gate, beta = _projections(x, w)
    qkv = short_conv(qkv, w.conv, state.conv[layer])
    if T == 1 and recurrent is not False and (o := native.kda_token_(qkv, f, gate, beta, w.dt_bias,
            w.a, cfg.lower_bound, w.o_norm, cfg.rms_eps, _L2_EPS, state.ssm[layer])) is not None:
        return w.wo(o.to(x.dtype))                                    # steps 2-5 in one call
    q, k, v = qkv.view(T, 3, H, Dk).unbind(1)
    q = l2_norm(q).mul_(Dk ** -0.5)
    k = l2_norm(k)
    g = _log_decay(f, w, cfg)
    beta = torch.sigmoid(beta)                                          # [T, H]
    S = state.ssm[layer]
    if recurrent if recurrent is not None else T == 1:
        o, _ = delta_rule_step(q, k, v, g, beta, S, inplace=True)
    else:
        o, S_new = delta_rule_chunked(q, k, v, g, beta, S, cfg.chunk)
        S.copy_(S_new)
    o = rms_norm(o.contiguous(), w.o_norm, cfg.rms_eps).mul_(torch.sigmoid(gate.view(T, H, Dk)))
    return w.wo(o.reshape(T, cfg.d_inner).to(x.dtype))
