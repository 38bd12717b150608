"""The DSA lightning indexer (DeepSeek sparse attention), as llama.cpp and transformers compute it.

Per query ``t`` and cached position ``s`` (llama.cpp ``src/models/glm-dsa.cpp``, transformers
``GlmMoeDsaIndexer``)::

    q[t]   = Wq_b · qr[t]                      [H, D]  (qr: the normed q_a latent of the MLA)
    k[s]   = LayerNorm(Wk · x[s]) (weight, bias)  [D]  one key per position, cached from the
                                                        first token on
    w[t]   = Wproj · x[t] / sqrt(D · H)        [H]
    RoPE   pairs (2i, 2i+1) on the FIRST n_rot dims of q and k (layout [rope | nope])
    score[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s])        causal: s ≤ p0 + t
    selection   = top min(top_k, S) positions of score[t]

llama.cpp's Walsh-Hadamard rotation of q and k leaves every dot product unchanged and is left
out. While no query sees more than ``top_k`` positions the selection is everything visible and
``select`` answers None (dense attention, exact). ``full`` (``attention.indexer.types``) marks
the layers that run an indexer; a "shared" layer reuses the selection of the most recent full
layer of the same forward (``Selection`` carries it from layer to layer).

The key cache is a side stream of the model's ``KVCache`` (``STREAM``, one ``[1, cap, D]``
tensor per full layer, compute dtype), so it grows, rolls back and is counted with the rest of
the cache. H=indexer heads, D=indexer head dim, T=tokens, S=visible positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .attention import KVCache
from .weights import Linear

__all__ = ["IndexerConfig", "IndexerWeights", "Selection", "STREAM", "add_key_cache",
           "indexer_select", "score_chunk_rows", "KPoolWeights", "KG_STREAM", "POOL_STREAM",
           "add_kpool_cache", "kpool_select"]

STREAM = "indexer_k"
KG_STREAM, POOL_STREAM = "indexer_kg", "indexer_pool"
#: score rows are computed in chunks of at most this many (query, head, position) products
SCORE_CHUNK = 1 << 24


@dataclass(frozen=True)
class IndexerConfig:
    n_head: int                      # attention.indexer.head_count
    head_dim: int                    # attention.indexer.key_length
    top_k: int                       # attention.indexer.top_k
    n_rot: int                       # RoPE dims at the start of each head (0: none)
    full: tuple[bool, ...]           # per trunk layer: runs its own indexer
    k_norm_eps: float = 1e-6         # the key LayerNorm's eps (transformers' value)
    kpool: int = 1                   # glm5-next: keys pooled in groups of kpool (1 = none)
    select_tail: bool = False        # attention.indexer.kpool_select_tail

    @property
    def scale(self) -> float:
        return (self.head_dim * self.n_head) ** -0.5

    def last_full(self, layer: int) -> int | None:
        """The full layer whose selection ``layer`` uses (itself when full)."""
        for i in range(min(layer, len(self.full) - 1), -1, -1):
            if self.full[i]:
                return i
        return None


@dataclass
class IndexerWeights:
    wq_b: Linear                     # [H D, q_lora]      indexer.attn_q_b
    wk: Linear                       # [D, n_embd]        indexer.attn_k
    k_norm: torch.Tensor             # [D] float32        indexer.k_norm.weight
    k_norm_b: torch.Tensor | None    # [D] float32        indexer.k_norm.bias
    proj: Linear                     # [H, n_embd]        indexer.proj (F32 in files)


@dataclass
class KPoolWeights(IndexerWeights):
    gate: Linear | None = None       # [D, n_embd]        indexer_compressor_gate (F32)
    ape: torch.Tensor | None = None  # [kpool, D] float32 indexer_compressor_ape


class Selection:
    """The selection of the most recent full indexer layer of one forward."""

    __slots__ = ("idx",)

    def __init__(self) -> None:
        self.idx: torch.Tensor | None = None       # [T, k] int64, or None = dense


def add_key_cache(cache: KVCache, icfg: IndexerConfig) -> None:
    """Register the indexer key stream (full layers only) in ``cache``."""
    cache.add_stream(STREAM, [icfg.head_dim if f else 0 for f in icfg.full])


def score_chunk_rows(n_head: int, n_pos: int) -> int:
    return max(1, SCORE_CHUNK // max(1, n_head * n_pos))


def _keys(x: torch.Tensor, w: IndexerWeights, icfg: IndexerConfig,
          rotate: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    k = F.layer_norm(w.wk(x).float(), (icfg.head_dim,), w.k_norm, w.k_norm_b, icfg.k_norm_eps)
    if rotate is not None and icfg.n_rot:
        k = rotate(k[:, None, :])[:, 0]
    return k                                                      # [T, D] float32


def indexer_select(x: torch.Tensor, qr: torch.Tensor, w: IndexerWeights, icfg: IndexerConfig,
                   cache: KVCache, layer: int,
                   rotate: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor | None:
    """``x [T, n_embd]`` (the attention input), ``qr [T, q_lora]`` → the top positions
    ``[T, min(top_k, S)]`` (int64) of every query, or None while no query sees more than
    ``top_k`` positions. Writes this batch's keys at ``cache.pos``; ``rotate`` applies the
    RoPE of these tokens' positions to ``[T, heads, dims]``."""
    T, H, D = x.shape[0], icfg.n_head, icfg.head_dim
    p0 = cache.pos
    S = p0 + T
    kc = cache.streams[STREAM][layer]                             # [1, cap, D]
    kc[0, p0:S] = _keys(x, w, icfg, rotate).to(kc.dtype)
    if S <= icfg.top_k:
        return None
    q = w.wq_b(qr).float().view(T, H, D)
    if rotate is not None and icfg.n_rot:
        q = rotate(q)
    wt = w.proj(x).float() * icfg.scale                           # [T, H]
    keys = kc[0, :S].float()                                      # [S, D]
    k = min(icfg.top_k, S)
    out = torch.empty(T, k, dtype=torch.int64, device=x.device)
    step = score_chunk_rows(H, S)
    for a in range(0, T, step):
        b = min(T, a + step)
        qk = torch.einsum("thd,sd->ths", q[a:b], keys).relu_()    # [t, H, S]
        score = torch.einsum("th,ths->ts", wt[a:b], qk)           # [t, S]
        rows = torch.arange(a, b, device=x.device)[:, None] + p0
        score.masked_fill_(torch.arange(S, device=x.device)[None, :] > rows, float("-inf"))
        out[a:b] = score.topk(k, dim=-1).indices
    return out


# --- glm5-next: the k-pool indexer ----------------------------------------------------------
#
# Keys are scored per pool of ``kpool`` consecutive positions (pool p = positions
# [p·kpool, (p+1)·kpool)), llama.cpp's ``build_kpool_select`` / transformers'
# ``Glm5NextTextIndexer``: a complete pool's key is ``Σ_j softmax_j(gate_j + ape_j) ⊙ key_j``
# (per channel, over the pool's positions; ``gate = indexer_compressor_gate · x``), a pool is
# visible to a query once its last position is, the top ``min(top_k / kpool, pools)`` visible
# pools are attended in full, and with ``select_tail`` also the query's incomplete pool (the
# visible positions after its last complete pool). No RoPE. Per full layer the cache holds each
# position's key | gate (``KG_STREAM``, 2·D, for the pools still open and for rollback) and the
# pooled keys, pool p's D values spread over its kpool rows (``POOL_STREAM``, D / kpool each).


def add_kpool_cache(cache: KVCache, icfg: IndexerConfig) -> None:
    cache.add_stream(KG_STREAM, [2 * icfg.head_dim if f else 0 for f in icfg.full])
    cache.add_stream(POOL_STREAM, [icfg.head_dim // icfg.kpool if f else 0 for f in icfg.full])


def kpool_select(x: torch.Tensor, qr: torch.Tensor, w: KPoolWeights, icfg: IndexerConfig,
                 cache: KVCache, layer: int) -> torch.Tensor | None:
    """``x [T, n_embd]``, ``qr [T, q_lora]`` → a boolean keep mask ``[T, S]`` (causal within
    it), or None while every query's selection is everything it sees. Writes this batch's
    key | gate rows at ``cache.pos`` and pools the pools this batch completes."""
    T, H, D, P = x.shape[0], icfg.n_head, icfg.head_dim, icfg.kpool
    p0 = cache.pos
    S = p0 + T
    kg = cache.streams[KG_STREAM][layer][0]                       # [cap, 2D]
    k = F.layer_norm(w.wk(x).float(), (D,), w.k_norm, w.k_norm_b, icfg.k_norm_eps)
    kg[p0:S] = torch.cat((k, w.gate(x).float()), dim=-1).to(kg.dtype)
    pool = cache.streams[POOL_STREAM][layer][0]                   # [cap, D / P]
    a, n_pool = p0 // P, S // P                                   # pools a .. n_pool-1 close now
    if n_pool > a:
        rows = kg[a * P:n_pool * P].float().view(n_pool - a, P, 2 * D)
        prob = torch.softmax(rows[..., D:] + w.ape, dim=1)        # over the pool's positions
        pool[a * P:n_pool * P] = (prob * rows[..., :D]).sum(1).reshape(-1, D // P).to(pool.dtype)
    n_top = min(icfg.top_k // P, n_pool)
    if icfg.select_tail and n_pool <= icfg.top_k // P:
        return None                                               # every visible pool + tail
    dev = x.device
    seen = torch.arange(T, device=dev)[:, None] + p0 + 1          # [T, 1] positions visible
    keep = torch.zeros(T, S, dtype=torch.bool, device=dev)
    if n_top:
        keys = pool[:n_pool * P].float().reshape(n_pool, D)
        q = w.wq_b(qr).float().view(T, H, D)
        wt = w.proj(x).float() * icfg.scale                       # [T, H]
        closed = (torch.arange(n_pool, device=dev)[None, :] + 1) * P <= seen   # [T, pools]
        step = score_chunk_rows(H, n_pool)
        for r in range(0, T, step):
            e = min(T, r + step)
            qk = torch.einsum("thd,pd->thp", q[r:e], keys).relu_()
            score = torch.einsum("th,thp->tp", wt[r:e], qk).masked_fill_(~closed[r:e],
                                                                          float("-inf"))
            top = score.topk(n_top, dim=-1)
            chosen = torch.zeros(e - r, n_pool, dtype=torch.bool, device=dev).scatter_(
                1, top.indices, top.values > float("-inf"))
            keep[r:e, :n_pool * P] = chosen.repeat_interleave(P, dim=1)
    if icfg.select_tail:
        pos = torch.arange(S, device=dev)[None, :]
        keep |= (pos >= seen // P * P) & (pos < seen)
    return keep
