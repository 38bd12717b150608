"""DeepSeek multi-head latent attention (deepseek2), in llama.cpp's absorbed form.

Per token: ``q = Wq x`` (or ``Wq_b RMSNorm(Wq_a x)``) split per head into ``q_nope`` and
``q_pe``; ``[c ; k_pe] = Wkv_a x`` with ``c = RMSNorm(c)`` the latent of ``kv_lora`` values and
``k_pe`` one shared RoPE key. The key projection is absorbed into the query
(``q_abs[h] = Wk_b[h] q_nope[h]``), so attention is MQA over the cached latents:
``Q = [q_abs ; rope(q_pe)]``, ``K = [c ; rope(k_pe)]``, ``V = c``, scale
``mscale² / sqrt(nope + rope)``; each head's output latent is expanded by ``Wv_b[h]`` and
projected by ``Wo``. With a ``select`` (DSA: ``indexer``) each query attends only to the
cached positions it selects. Tensors: ``attn_q`` or ``attn_q_a``/``attn_q_a_norm``/``attn_q_b``,
``attn_kv_a_mqa``, ``attn_kv_a_norm``, ``attn_k_b`` [H, kv_lora, nope], ``attn_v_b``
[H, v, kv_lora], ``attn_output``.

``k_b``/``v_b`` are ``HeadMatrices``: float, or their ggml bytes multiplied by the native
kernels (llama.cpp's ``ggml_mul_mat`` of the 3-D tensor: one matrix per head, rows of the
contracted dimension): a decode step is one native call per tensor, every head's product in
it; a batch of up to ``HEAD_MAX_TOKENS`` tokens one native product per head (the rows kernels up
to the type's ``kernels.max_tokens``, the panel product past it); a bigger one dequantizes the
tensor for that call (float32, freed after it).

T=tokens, H=heads, L=kv_lora, R=rope dims, N=nope dims, V=value dims, S=cached positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...formats.dequant import dequantize
from .. import kernels as native
from ..kernels import gemm
from . import scratch
from .attention import KVCache
from .config import ModelConfig
from .rope import Rope, rms_norm
from .weights import Linear, RawTensor

__all__ = ["MLAWeights", "HeadMatrices", "HEAD_MAX_TOKENS", "mla_attention"]

#: Most tokens ``HeadMatrices`` multiplies through the native kernels (one small matrix per
#: head, re-read from cache for every token); beyond it dequantizing the tensor for the call
#: and one batched product measured faster (bench/README.md).
HEAD_MAX_TOKENS = 128
#: Fewest tokens for which a head's product goes through the panel product (``kernels.qgemm``)
#: rather than the rows kernels: a head's matrix is small (DeepSeek-V3: 512 x 128), so the
#: panel's fixed cost pays later than on the expert and trunk shapes the types' limits were
#: measured on; on 128 heads of Q5_0, Q4_K and Q8_0 it loses at 16 tokens and wins from 32
#: (bench/README.md, "The panel product for MLA's heads").
HEAD_PANEL_TOKENS = 32


class HeadMatrices:
    """``H`` matrices ``[R, C]`` (one per head, torch shape ``[H, R, C]``): ``apply(x [T, H, C])``
    → ``[T, H, R]``, ``y[t, h] = W[h] x[t, h]``. Either a float tensor (``weight``) or ggml bytes
    (``raw``, every head's rows contiguous) for the native kernels; ``quantized`` builds the
    second from a ``RawTensor`` where the kernels take its type (else None)."""

    __slots__ = ("weight", "raw", "heads", "ggml_type", "shape", "max_tokens", "act_quant")

    def __init__(self, weight: torch.Tensor | None, raw: RawTensor | None = None) -> None:
        self.weight, self.raw = weight, raw
        src = weight if weight is not None else raw
        self.shape: tuple[int, int, int] = tuple(int(n) for n in src.shape)
        self.ggml_type = None if raw is None else raw.ggml_type
        self.heads = None if raw is None else list(raw.raw.view(self.shape[0], -1).unbind(0))
        self.max_tokens = 0 if raw is None else HEAD_MAX_TOKENS
        self.act_quant: str | None = None   # "q8": llama.cpp's 8-bit activations (loader)

    @classmethod
    def quantized(cls, raw: RawTensor) -> HeadMatrices | None:
        if (len(raw.shape) != 3 or raw.ggml_type not in native.TYPES or not raw.raw.is_cpu
                or not native.available()):
            return None
        return cls(None, raw)

    @property
    def nbytes(self) -> int:
        t = self.weight if self.weight is not None else self.raw.raw
        return t.numel() * t.element_size()

    def dense(self, dtype: torch.dtype = torch.float32,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """The float ``[H, R, C]`` tensor (dequantized for the call when kept as bytes: on the
        CPU in float32 by the native kernels, gguf-py's bits, into the float32 buffer ``out``
        where one is given)."""
        if self.weight is not None:
            return self.weight.to(dtype)
        r = self.raw
        if dtype == torch.float32 and r.raw.is_cpu:
            H, R, C = self.shape
            w = native.dequant(r.raw, r.ggml_type, (H * R, C), out=out)
            if w is not None:
                return w.view(H, R, C)
        return dequantize(r.raw, r.ggml_type, r.shape, dtype=dtype)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        T, (H, R, C) = x.shape[0], self.shape
        if T <= self.max_tokens and x.is_cpu:
            xf = x.float()
            if T == 1:                         # every head in one call: row h by matrix h
                y = native.moe_down_rows(xf[0].contiguous(), self.heads, self.ggml_type, R,
                                         self.act_quant)
                if y is not None:
                    return y.view(1, H, R).to(x.dtype)
            else:
                xh = xf.transpose(0, 1).contiguous()                   # [H, T, C]
                # from HEAD_PANEL_TOKENS and past the type's own limit each head's matrix is
                # decoded once, into a panel, for all T tokens (kernels.qgemm), not once per
                # pass of the rows kernels
                wide = T >= max(HEAD_PANEL_TOKENS, native.max_tokens(self.ggml_type, 0) + 1)
                product = native.qgemm if wide else native.matvec
                ys = [product(xh[h], self.heads[h], self.ggml_type, (R, C), self.act_quant)
                      for h in range(H)]
                if all(y is not None for y in ys):
                    return torch.stack(ys, dim=1).to(x.dtype)
        if self.weight is not None:
            w = self.weight
        else:   # in this thread's scratch (``model.scratch``: DeepSeek-V3's 128 heads of 512 x
            #     128 are 32 MiB, past glibc's mmap threshold), valid until the next call
            f32 = x.is_cpu and x.dtype == torch.float32
            w = self.dense(x.dtype, scratch.buffer("mla_heads", H * R * C) if f32 else None)
        return torch.einsum("thc,hrc->thr", x, w.to(x.dtype))


@dataclass
class MLAWeights:
    wkv_a: Linear                   # [L + R, D]
    kv_a_norm: torch.Tensor         # [L]
    k_b: HeadMatrices               # [H, L, N]
    v_b: HeadMatrices               # [H, V, L]
    wo: Linear
    wq: Linear | None = None        # [H (N + R), D]  (V2-Lite)
    wq_a: Linear | None = None
    q_a_norm: torch.Tensor | None = None
    wq_b: Linear | None = None

    def __post_init__(self) -> None:
        if isinstance(self.k_b, torch.Tensor):
            self.k_b = HeadMatrices(self.k_b)
        if isinstance(self.v_b, torch.Tensor):
            self.v_b = HeadMatrices(self.v_b)


Select = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor | None]


def mla_attention(x: torch.Tensor, w: MLAWeights, cfg: ModelConfig, rope: Rope,
                  cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                  mask: torch.Tensor | None, select: Select | None = None) -> torch.Tensor:
    """``x [T, D]`` (normed) → ``[T, D]``; appends T latent positions to the cache.

    ``select(x, qr)`` (``qr`` the normed q_a latent, None without q_lora) → ``[T, k]`` cached
    positions per query (int64; causality still applies), or None for dense attention; it
    runs before this batch's latents are counted (``cache.pos`` is still the first row's); a
    boolean ``[T, S]`` answer is a keep mask instead (glm5-next's k-pool selection).
    ``rope.dimension_count`` 0 (glm5-next): no RoPE part, the cache holds the latent only."""
    T, H, N, R, L = x.shape[0], cfg.n_head, cfg.qk_nope, cfg.n_rot, cfg.kv_lora_rank
    qr = None
    if w.wq is not None:
        q = w.wq(x)
    else:
        qr = rms_norm(w.wq_a(x), w.q_a_norm, cfg.rms_eps)
        q = w.wq_b(qr)
    q = q.view(T, H, N + R)
    idx = select(x, qr) if select is not None else None
    kv = w.wkv_a(x)                                                    # [T, L + R]
    c = rms_norm(kv[:, :L], w.kv_a_norm, cfg.rms_eps)                  # [T, L]
    p0 = cache.pos
    kc = cache.k[layer]                                                # [1, cap, L + R]
    q_pe = None
    if R:
        k_pe = rope.apply(kv[:, L:].reshape(T, 1, R), cos, sin)        # [T, 1, R]
        q_pe = rope.apply(q[..., N:], cos, sin)                        # [T, H, R]
        kc[0, p0:p0 + T] = torch.cat((c, k_pe[:, 0]), dim=-1)
    else:                                                              # nope-only (glm5-next)
        kc[0, p0:p0 + T] = c

    def absorbed(a: int, b: int) -> torch.Tensor:     # queries a..b-1 as [b - a, H, L + R]
        q_abs = w.k_b.apply(q[a:b, :, :N])                             # [b - a, H, L]
        return q_abs if q_pe is None else torch.cat((q_abs, q_pe[a:b]), dim=-1)

    def by_chunks(attend: Callable[[int, int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``attend(a, b, Q)`` (queries a..b-1 absorbed → ``[b - a, H, L]``) over the batch a
        chunk of tokens at a time: a prompt batch's absorbed queries whole would be T x H x
        (L + R) floats twice over (75 MB each for 256 tokens of DeepSeek-V3's 128 heads)."""
        step = max(1, MLA_QUERY_CHUNK // (H * (L + R)))
        if T <= step:
            return attend(0, T, absorbed(0, T))
        out = (scratch.buffer("mla_out", T * H * L).view(T, H, L)   # consumed by _out
               if q.dtype == torch.float32 and q.is_cpu else
               torch.empty(T, H, L, dtype=q.dtype, device=q.device))
        for a in range(0, T, step):
            b = min(T, a + step)
            out[a:b] = attend(a, b, absorbed(a, b))
        return out

    S = p0 + T
    k = kc[None, :, :S]                                                # [1, 1, S, L + R]
    if idx is not None and idx.dtype == torch.bool:                    # a [T, S] keep mask
        if mask is not None:
            idx = idx & mask
        if T == 1:
            idx = idx[0].nonzero()[:, 0][None]                         # [1, k] its positions
        else:
            n = int(idx.sum(1).max())
            if 2 * n > S:                                              # dense is as cheap
                mask, idx = idx, None
            else:                                                      # kept positions first
                order = torch.argsort(idx.to(torch.uint8), dim=1, descending=True, stable=True)
                sel, kept = order[:, :n], idx.gather(1, order[:, :n])
                return _out(by_chunks(lambda a, b, Qc: _sparse(Qc, kc[0], sel[a:b], kept[a:b], L,
                                                               cfg.kq_scale)), w, cfg)
    if idx is not None and T == 1:
        k, mask = kc[None, :, idx[0]], None                            # [1, 1, k, L + R]
    elif idx is not None:                                              # [T, k] positions
        valid = idx <= torch.arange(p0, S, device=x.device)[:, None]   # causal (top-k pads)
        if mask is not None:
            valid &= mask.gather(1, idx)
        return _out(by_chunks(lambda a, b, Qc: _sparse(Qc, kc[0], idx[a:b], valid[a:b], L,
                                                       cfg.kq_scale)), w, cfg)
    return _out(by_chunks(lambda a, b, Qc: _mqa(Qc, k[0, 0], L, None if mask is None else
                                                mask[a:b], cfg.kq_scale)), w, cfg)


#: the attention absorbs at most this many (query, head, latent) elements at once
MLA_QUERY_CHUNK = 1 << 22


#: the dense MQA's scores are formed for at most this many (query, head, position) at once
MQA_CHUNK = 1 << 23


def _mqa(Q: torch.Tensor, k: torch.Tensor, L: int, mask: torch.Tensor | None,
         scale: float) -> torch.Tensor:
    """Every head against the one shared latent key: ``Q [T, H, L + R]``, ``k [S, L + R]``
    (``V = k[:, :L]``), ``mask [T, S]`` (True = attend) or None → ``[T, H, L]``. Two products
    over the query rows of each chunk of tokens (the scores of a long prompt are never whole);
    SDPA with ``enable_gqa`` would copy the cache once per head."""
    T, H, S = Q.shape[0], Q.shape[1], k.shape[0]
    out = torch.empty(T, H, L, dtype=Q.dtype, device=Q.device)
    kt, v = k.transpose(0, 1), k[:, :L]
    # a prompt's products through oneDNN where the box chose it (gemm.linear: its AVX-512 where
    # MKL would take its AVX2 code; gemm.linear falls back to F.linear for what it does not
    # take); V transposed once for it while that copy is small (up to 2048 positions of a 512
    # latent: 4 MiB), and only there: elsewhere the copy would buy nothing
    wide = T > 1 and Q.is_cpu and gemm.backend() == "onednn"
    vt = v.t().contiguous() if wide and S * L <= MQA_CHUNK // 8 else None
    step = max(1, MQA_CHUNK // max(1, H * S))
    for a in range(0, T, step):
        b = min(T, a + step)
        q2 = Q[a:b].reshape((b - a) * H, -1)
        s = (gemm.linear(q2, k) if wide else q2 @ kt).view(b - a, H, S) * scale
        if mask is not None:
            s.masked_fill_(~mask[a:b, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(k.dtype).view((b - a) * H, S)
        out[a:b] = (gemm.linear(p, vt) if vt is not None else p @ v).view(b - a, H, L)
    return out


def _out(o: torch.Tensor, w: MLAWeights, cfg: ModelConfig) -> torch.Tensor:
    """Per-head output latents ``[T, H, L]`` → ``[T, D]`` (``Wv_b`` per head, then ``Wo``)."""
    T, H = o.shape[0], o.shape[1]
    o = w.v_b.apply(o)                                                 # [T, H, V]
    return w.wo(o.reshape(T, H * cfg.v_head_mla))


#: sparse attention gathers the selected latents of at most this many (query, position, dim)
SPARSE_CHUNK = 1 << 23


def _sparse(Q: torch.Tensor, kc: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, L: int,
            scale: float) -> torch.Tensor:
    """Each query's attention over its own selected positions only: ``Q [T, H, L + R]``,
    the cache ``kc [cap, L + R]``, ``idx``/``valid [T, k]`` (positions, and which of them
    count) → ``[T, H, L]``; ``O(T·k)`` instead of the dense ``O(T·S)``, in chunks of rows."""
    T, n = idx.shape
    out = torch.empty(T, Q.shape[1], L, dtype=Q.dtype, device=Q.device)
    step = max(1, SPARSE_CHUNK // max(1, n * kc.shape[1]))
    for a in range(0, T, step):
        b = min(T, a + step)
        kg = kc[idx[a:b]]                                              # [t, k, L + R]
        s = torch.einsum("thd,tkd->thk", Q[a:b], kg) * scale
        s.masked_fill_(~valid[a:b, None, :], float("-inf"))
        out[a:b] = torch.einsum("thk,tkl->thl", torch.softmax(s, dim=-1), kg[..., :L])
    return out
