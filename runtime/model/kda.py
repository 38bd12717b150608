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
5. ``o = RMSNorm(o) · ssm_norm`` per head, times ``sigmoid(Wg_b Wg_a x)``; ``Wo``.

The conv windows and ``S`` are kept in float32 in ``KDAState`` (``KDAState.layer_bytes`` for the
memory model: llama.cpp's ``n_embd_r + n_embd_s`` floats per layer).

T=tokens, D=embedding, H=heads, Dk=Dv=head dim, C=chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F

from .rope import rms_norm
from .weights import Linear

__all__ = ["KDA_TENSORS", "KDAConfig", "KDAWeights", "KDAState", "kda_attention",
           "short_conv", "decay_gate", "l2_norm", "delta_rule_step", "delta_rule_chunked"]

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

    def __post_init__(self) -> None:
        convs = [c.float().reshape(-1, c.shape[-1]) for c in (self.q_conv, self.k_conv, self.v_conv)]
        self.q_conv, self.k_conv, self.v_conv = convs
        self.conv = torch.cat(convs, dim=0).contiguous()
        self.a = self.a.float().reshape(-1)
        self.dt_bias = self.dt_bias.float().reshape(-1)
        self.o_norm = self.o_norm.float().contiguous()

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
        conv, ssm = snap
        for il in self.layers:
            self.conv[il].copy_(conv[il])
            self.ssm[il].copy_(ssm[il])


def short_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + SiLU: ``x [T, C]``, ``weight [C, d_conv]``, ``window [C, d_conv-1]``
    (updated in place to the last ``d_conv - 1`` inputs) → ``[T, C]`` float32."""
    T, K = x.shape[0], weight.shape[1]
    xx = torch.cat((window, x.float().t()), dim=1)                    # [C, K - 1 + T]
    if T == 1:
        y = (xx * weight).sum(-1, keepdim=True)                        # [C, 1]
    else:
        y = F.conv1d(xx[None], weight[:, None, :], groups=weight.shape[0])[0]   # [C, T]
    if K > 1:
        window.copy_(xx[:, -(K - 1):])
    return F.silu(y).t()


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def decay_gate(x: torch.Tensor, w: KDAWeights, cfg: KDAConfig) -> torch.Tensor:
    """Per-channel log-decay ``g [T, H, Dk]`` (float32, ≤ 0)."""
    T = x.shape[0]
    f = (w.f_b(w.f_a(x)).float() + w.dt_bias).view(T, cfg.n_head, cfg.head_dim)
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
    ``S ← e ⊙ S + k δᵀ`` (one read of S for both products, one in-place update)."""
    S = S if inplace else S.clone()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        e = g[t].exp()                                                  # [H, Dk]
        r = torch.bmm(torch.stack((k[t] * e, q[t] * e), dim=1), S)      # [H, 2, Dv]
        d = (v[t] - r[:, 0]) * beta[t][:, None]                         # [H, Dv]
        out[t] = r[:, 1] + (q[t] * k[t]).sum(-1, keepdim=True) * d
        S.mul_(e[..., None]).baddbmm_(k[t][:, :, None], d[:, None, :])
    return out, S


def _chunk_spans(g: torch.Tensor, chunk: int) -> list[float]:
    """Per chunk, the largest log-decay from its first token to its last (one host sync)."""
    T = g.shape[0]
    pad = (-T) % chunk
    gg = F.pad(g, (0, 0, 0, 0, 0, pad)).view(-1, chunk, *g.shape[1:])
    return (-gg[:, 1:].sum(1)).flatten(1).amax(1).tolist()


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, S: torch.Tensor,
                       chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence in chunks of ``chunk`` tokens (the last may be shorter).

    Within a chunk, with ``G`` the cumulative log-decay and ``Γ = exp G``: the deltas solve
    ``(I + tril₋₁(β ⊙ A_kk)) δ = β ⊙ (v - (k⊙Γ) S)``, ``o = (q⊙Γ) S + tril(A_qk) δ``,
    ``S ← Γ_last ⊙ S + (k ⊙ Γ_last/Γ)ᵀ δ``, where ``A_xk[t, s] = Σ_d x_td k_sd exp(G_td - G_sd)``.
    ``A`` is a product of matrices ``x⊙exp(G - G_0)`` and ``k⊙exp(G_0 - G)`` when the chunk's
    decay span keeps ``exp`` finite (``_MAX_SPAN``), else it is formed from the decays
    themselves (all ≤ 1), so no chunk overflows.
    """
    T = q.shape[0]
    spans = _chunk_spans(g, chunk)
    outs = []
    for ci, s0 in enumerate(range(0, T, chunk)):
        sl = slice(s0, min(s0 + chunk, T))
        qc, kc, vc = (x[sl].transpose(0, 1) for x in (q, k, v))      # [H, C, *]
        bc = beta[sl].t()                                               # [H, C]
        G = g[sl].transpose(0, 1).cumsum(1)                             # [H, C, Dk]
        C = G.shape[1]
        if spans[ci] <= _MAX_SPAN:
            kr = kc * (G[:, :1] - G).exp()
            left = torch.cat((kc, qc), dim=1) * (G - G[:, :1]).exp().repeat(1, 2, 1)
            A_kk, A_qk = (left @ kr.transpose(1, 2)).split(C, dim=1)
            A_qk = A_qk.tril()
        else:
            causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
            dec = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(
                ~causal[None, :, :, None], float("-inf")).exp()
            A_kk = torch.einsum("htd,hsd,htsd->hts", kc, kc, dec)
            A_qk = torch.einsum("htd,hsd,htsd->hts", qc, kc, dec)
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        M = (A_kk * bc[:, :, None]).tril(-1) + eye
        eG = G.exp()
        rhs = bc[..., None] * (vc - (kc * eG) @ S)                      # [H, C, Dv]
        delta = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
        outs.append(((qc * eG) @ S + A_qk @ delta).transpose(0, 1))
        G_last = G[:, -1:, :]                                           # [H, 1, Dk]
        S = S * G_last.transpose(1, 2).exp() + (kc * (G_last - G).exp()).transpose(1, 2) @ delta
    return torch.cat(outs, dim=0), S


def kda_attention(x: torch.Tensor, w: KDAWeights, cfg: KDAConfig, state: KDAState, layer: int,
                  *, recurrent: bool | None = None) -> torch.Tensor:
    """``x [T, D]`` (attn-normed) → ``[T, D]`` in ``x.dtype``; advances ``state`` by T tokens.

    ``recurrent``: token-by-token recurrence (default for T = 1) or chunked (default T > 1)."""
    T, H, Dk = x.shape[0], cfg.n_head, cfg.head_dim
    qkv = torch.cat((w.wq(x), w.wk(x), w.wv(x)), dim=-1)
    qkv = short_conv(qkv, w.conv, state.conv[layer]).view(T, 3, H, Dk)
    q, k, v = qkv.unbind(1)
    q = l2_norm(q) * Dk ** -0.5
    k = l2_norm(k)
    g = decay_gate(x, w, cfg)
    beta = torch.sigmoid(w.beta(x).float())                             # [T, H]
    S = state.ssm[layer]
    if recurrent if recurrent is not None else T == 1:
        o, _ = delta_rule_step(q, k, v, g, beta, S, inplace=True)
    else:
        o, S_new = delta_rule_chunked(q, k, v, g, beta, S, cfg.chunk)
        S.copy_(S_new)
    gate = w.g_b(w.g_a(x)).float().view(T, H, Dk)
    o = rms_norm(o.contiguous(), w.o_norm, cfg.rms_eps) * torch.sigmoid(gate)
    return w.wo(o.reshape(T, cfg.d_inner).to(x.dtype))
