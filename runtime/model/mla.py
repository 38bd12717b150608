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

T=tokens, H=heads, L=kv_lora, R=rope dims, N=nope dims, V=value dims, S=cached positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .attention import KVCache
from .config import ModelConfig
from .rope import Rope, rms_norm
from .weights import Linear

__all__ = ["MLAWeights", "mla_attention"]


@dataclass
class MLAWeights:
    wkv_a: Linear                   # [L + R, D]
    kv_a_norm: torch.Tensor         # [L]
    k_b: torch.Tensor               # [H, L, N] compute dtype
    v_b: torch.Tensor               # [H, V, L]
    wo: Linear
    wq: Linear | None = None        # [H (N + R), D]  (V2-Lite)
    wq_a: Linear | None = None
    q_a_norm: torch.Tensor | None = None
    wq_b: Linear | None = None


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
    q_abs = torch.einsum("thn,hln->thl", q[..., :N], w.k_b)            # [T, H, L]
    p0 = cache.pos
    kc = cache.k[layer]                                                # [1, cap, L + R]
    if R:
        k_pe = rope.apply(kv[:, L:].reshape(T, 1, R), cos, sin)        # [T, 1, R]
        q_pe = rope.apply(q[..., N:], cos, sin)                        # [T, H, R]
        Q = torch.cat((q_abs, q_pe), dim=-1)                           # [T, H, L + R]
        kc[0, p0:p0 + T] = torch.cat((c, k_pe[:, 0]), dim=-1)
    else:                                                              # nope-only (glm5-next)
        Q = q_abs
        kc[0, p0:p0 + T] = c
    S = p0 + T
    k = kc[None, :, :S]                                                # [1, 1, S, L + R]
    if idx is not None and idx.dtype == torch.bool:                    # a [T, S] keep mask
        mask = idx if mask is None else idx & mask
    elif idx is not None and T == 1:
        k, mask = kc[None, :, idx[0]], None                            # [1, 1, k, L + R]
    elif idx is not None:
        keep = torch.zeros(T, S, dtype=torch.bool, device=x.device).scatter_(1, idx, True)
        mask = keep if mask is None else keep & mask
    o = F.scaled_dot_product_attention(Q.transpose(0, 1)[None], k, k[..., :L], attn_mask=mask,
                                       scale=cfg.kq_scale, enable_gqa=True)   # [1, H, T, L]
    o = torch.einsum("htl,hvl->thv", o[0], w.v_b)                      # [T, H, V]
    return w.wo(o.reshape(T, H * cfg.v_head_mla))
