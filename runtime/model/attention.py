"""Grouped-query attention with optional q/k RMSNorm and qkv biases, and its KV cache.

llama.cpp order (qwen3moe, glm4moe, llama): ``q = Wq x (+bq)``, ``k``, ``v`` likewise; reshape
to heads; q/k RMSNorm per head when the tensors exist; RoPE; softmax(q kᵀ · kq_scale) v over the
cache; ``Wo``. The cache holds keys after RoPE, ``[n_head_kv, capacity, head_dim]`` per layer in
the compute dtype, and grows by doubling up to ``n_ctx``. On the CPU each cache tensor is an
anonymous mapping of its own (``io.aligned_empty``: zero pages the kernel provides as they are
first written): one freed by a growth goes back to the system at once, where the allocator's
heap kept the freed blocks under its mapping threshold (``bench/state_at_ctx.py`` measures
both), so the process holds what ``plan`` counts.

T=tokens in the batch, S=cached positions, H=heads, K=KV heads, D=head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import UsageError
from .. import kernels as native
from ..io import aligned_empty
from .config import ModelConfig
from .rope import Rope
from .weights import Linear

__all__ = ["AttentionWeights", "KVCache", "attention", "cache_zeros"]


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                ) -> torch.Tensor:
    """A zero tensor for cache state: on the CPU an anonymous mapping of its own (a slab from
    2 MiB: huge pages where they pay, ``io.aligned_empty``), returned to the system when the
    tensor is freed; elsewhere ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return aligned_empty(math.prod(shape) * dtype.itemsize, slab=True).view(dtype).view(shape)


@dataclass
class AttentionWeights:
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class KVCache:
    """Per-layer key/value tensors; ``pos`` is the number of positions already stored.

    MLA (deepseek2) keeps one latent "head" per position, ``[kv_lora + rope]``, whose first
    ``kv_lora`` values are also the values: no separate value tensors. A layer kind with more
    per-position state (the DSA indexer's keys) registers a side stream (``add_stream``):
    ``streams[name][layer]`` is ``[1, capacity, dim]`` (None for the layers without one) and
    grows, rolls back and counts in ``nbytes`` with the keys. A layer without a KV cache (a
    linear-attention layer, ``drop``) holds None. A sliding-window layer may keep a ring of a
    fixed number of positions instead (``ring``: position ``p`` in slot ``p % size``; it does
    not grow, and its architecture's attention step reads and writes it)."""

    def __init__(self, cfg: ModelConfig, n_layers: int, n_ctx: int, dtype: torch.dtype,
                 device: torch.device, initial: int = 256) -> None:
        self.n_ctx, self.dtype, self.device = n_ctx, dtype, device
        if cfg.mla:
            self.kv_heads, self.kd, self.vd = 1, cfg.kv_lora_rank + cfg.n_rot, 0
        else:
            self.kv_heads, self.kd, self.vd = cfg.n_head_kv, cfg.head_dim, cfg.v_head_dim
        self.capacity = min(initial, n_ctx)
        self.k = [self._alloc(self.kd) for _ in range(n_layers)]
        self.v = [self._alloc(self.vd) for _ in range(n_layers)] if self.vd else []
        self.streams: dict[str, list[torch.Tensor | None]] = {}
        self.state_bytes = 0            # fixed per-sequence state held beside the cache (KDA)
        self.rings: dict[int, int] = {}  # layer -> ring size (positions), fixed
        self.pos = 0

    def add_stream(self, name: str, dims: list[int]) -> None:
        """One ``[1, capacity, dims[layer]]`` tensor per layer (none where the dim is 0)."""
        self.streams[name] = [cache_zeros((1, self.capacity, d), self.dtype, self.device)
                              if d else None for d in dims]

    def drop(self, layers: list[int]) -> None:
        """No keys or values for ``layers`` (they keep a state of their own)."""
        for i in layers:
            self.k[i] = None                                   # type: ignore[call-overload]
            if self.v:
                self.v[i] = None                               # type: ignore[call-overload]

    def ring(self, layers: list[int], size: int) -> None:
        """``layers`` keep ``size`` positions each, in a ring that does not grow."""
        for i in layers:
            self.rings[i] = size
            self.k[i] = self._alloc(self.kd, size)
            if self.v:
                self.v[i] = self._alloc(self.vd, size)

    def _alloc(self, d: int, n: int | None = None) -> torch.Tensor:
        return cache_zeros((self.kv_heads, n or self.capacity, d), self.dtype, self.device)

    def reserve(self, n_new: int) -> None:
        need = self.pos + n_new
        if need > self.n_ctx:
            raise UsageError(f"context of {need} tokens exceeds n_ctx {self.n_ctx}",
                             fix="pass a larger --ctx or a shorter prompt / fewer tokens")
        if need <= self.capacity:
            return
        cap = min(self.n_ctx, max(need, 2 * self.capacity))
        for lst, d in ((self.k, self.kd), (self.v, self.vd)):
            for i, t in enumerate(lst):
                if t is None or i in self.rings:
                    continue
                new = self._alloc(d, cap)
                new[:, :self.pos] = t[:, :self.pos]
                lst[i] = new
        for lst in self.streams.values():
            for i, t in enumerate(lst):
                if t is not None:
                    new = cache_zeros((t.shape[0], cap, t.shape[2]), t.dtype, t.device)
                    new[:, :self.pos] = t[:, :self.pos]
                    lst[i] = new
        self.capacity = cap

    def reset(self, pos: int = 0) -> None:
        """Forget positions from ``pos`` on (0: everything)."""
        self.pos = min(pos, self.pos)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None) + \
            sum(self.stream_nbytes(n) for n in self.streams) + self.state_bytes

    def stream_nbytes(self, name: str) -> int:
        return sum(t.numel() * t.element_size() for t in self.streams[name] if t is not None)


def attention(x: torch.Tensor, w: AttentionWeights, cfg: ModelConfig, rope: Rope,
              cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
              mask: torch.Tensor | None) -> torch.Tensor:
    """``x [T, n_embd]`` (normed) → attention output ``[T, n_embd]``; appends T positions."""
    T = x.shape[0]
    H, K, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    q = w.wq(x).view(T, H, D)                                  # [T, H, D]
    k = w.wk(x).view(T, K, D)                                  # [T, K, D]
    v = w.wv(x).view(T, K, cfg.v_head_dim)                     # [T, K, Dv]
    q = rope.norm_apply(q, w.q_norm, cfg.rms_eps, cos, sin)     # in place where native
    k = rope.norm_apply(k, w.k_norm, cfg.rms_eps, cos, sin)
    p0 = cache.pos
    kc, vc = cache.k[layer], cache.v[layer]
    if T == 1:
        o = native.attn_decode(q, k, v, kc, vc, p0, cfg.kq_scale)
        if o is not None:
            return w.wo(o)
    kc[:, p0:p0 + T] = k.transpose(0, 1)
    vc[:, p0:p0 + T] = v.transpose(0, 1)
    S = p0 + T
    qh = q.transpose(0, 1)[None]                               # [1, H, T, D]
    kh, vh = kc[None, :, :S], vc[None, :, :S]                  # [1, K, S, D]
    causal = p0 == 0 and mask is not None      # a prompt from the start: the causal kernels
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=None if causal else mask,
                                       is_causal=causal, scale=cfg.kq_scale,
                                       enable_gqa=H != K)      # [1, H, T, Dv]
    return w.wo(o[0].transpose(0, 1).reshape(T, H * cfg.v_head_dim))


def causal_mask(p0: int, T: int, device: torch.device) -> torch.Tensor | None:
    """Boolean ``[T, p0+T]`` mask (True = attend) for a batch after ``p0`` cached positions."""
    if T == 1:
        return None
    q = torch.arange(T, device=device)[:, None] + p0
    k = torch.arange(p0 + T, device=device)[None, :]
    return k <= q
