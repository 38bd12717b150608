"""glm-dsa (GLM-5.2, GLM-5): llama.cpp's ``src/models/glm-dsa.cpp`` from the layer kinds.

Block: RMSNorm → DeepSeek MLA with RoPE (``attn_q_a``/``attn_q_a_norm``/``attn_q_b``, absorbed
``attn_k_b``/``attn_v_b``, a cache of the latent only) over the positions the DSA lightning
indexer selects (``indexer``; full layers run it, shared layers reuse the most recent full
layer's selection) → residual → RMSNorm (``ffn_norm``) → SwiGLU on the leading dense blocks,
else the routed experts + one shared expert → residual. The stack, FFNs, router and expert path
are the generic ones; this module reads glm-dsa's keys, loads the indexer and runs the step.

Metadata as llama.cpp reads it: ``block_count`` includes the NextN block(s); the router is
sigmoid unless ``expert_gating_func`` says otherwise, ``exp_probs_b`` biases the choice,
``expert_weights_norm`` / ``expert_weights_scale`` weigh it; expert groups are not read (one
group). ``attention.indexer.{head_count, key_length, top_k}``; ``attention.indexer.types`` (bool
per trunk layer, true = full) — absent: every layer full before GLM-5.2 (``context_length`` under
2^20), GLM-5.2's pattern after. Eps: llama.cpp's ``rms_norm_eps`` for every RMSNorm; the
indexer key LayerNorm uses transformers' 1e-6 (llama.cpp 0; the difference is below rounding).
The NextN block runs dense MLA (llama.cpp's ``graph_mtp`` runs no indexer) with its own experts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from ....errors import StoreError, UnsupportedModelError
from ..attention import KVCache
from ..config import ModelConfig
from ..indexer import IndexerConfig, IndexerWeights, Selection, add_key_cache, indexer_select
from ..mla import MLAWeights, mla_attention
from ..rope import Rope

__all__ = ["DSAWeights", "Attention", "configure", "load_attention", "GLM_5_2_INDEXER_TYPES",
           "full_indexer_layers"]

#: llama.cpp's default for GLM-5.2 files without ``attention.indexer.types`` (78 layers)
GLM_5_2_INDEXER_TYPES = (True, True) + (True, False, False, False) * 19
_PRE_5_2_CTX = 1 << 20


@dataclass
class DSAWeights(MLAWeights):
    indexer: IndexerWeights | None = None      # full layers (and NextN blocks that carry one)


def _bools(v: Any, n: int) -> list[bool]:
    vals = v.tolist() if hasattr(v, "tolist") else v
    if not isinstance(vals, (list, tuple)):
        return [bool(vals)] * n
    return [bool(x) for x in vals]


def full_indexer_layers(types: Any, n_layers: int, n_ctx_train: int) -> list[bool]:
    """Which of ``n_layers`` layers run the indexer (the others reuse a selection), from
    ``attention.indexer.types`` or, without it, llama.cpp's default for the context length."""
    if types is None:
        default = (True,) * n_layers if n_ctx_train < _PRE_5_2_CTX else GLM_5_2_INDEXER_TYPES
        return list(default[:n_layers]) + [False] * max(0, n_layers - len(default))
    return _bools(types, n_layers)


def configure(cfg: ModelConfig, get: Callable[..., Any], path: str | None) -> ModelConfig:
    def bad(problem: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"glm-dsa: {problem}", path=path,
                                     fix="reconvert the model with llama.cpp's "
                                         "convert_hf_to_gguf.py (GlmMoeDsaModel)")

    n = cfg.n_layers
    heads = int(get("attention.indexer.head_count", 0) or 0)
    dim = int(get("attention.indexer.key_length", 0) or 0)
    top_k = int(get("attention.indexer.top_k", 0) or 0)
    if heads < 1 or dim < 1 or top_k < 1:
        raise bad(f"attention.indexer.head_count/key_length/top_k are {heads}/{dim}/{top_k}")
    if not cfg.q_lora_rank:
        raise bad("no attention.q_lora_rank (the indexer's query reads the q_a latent)")
    if cfg.n_rot > dim:
        raise bad(f"rope.dimension_count {cfg.n_rot} exceeds the indexer key length {dim}")
    full = full_indexer_layers(get("attention.indexer.types"), n, cfg.n_ctx_train)
    if len(full) < n:
        raise bad(f"attention.indexer.types has {len(full)} entries for {n} layers")
    if not full[0]:
        raise bad("the first layer's indexer is 'shared' (a shared layer needs a full one "
                  "before it)")
    icfg = IndexerConfig(heads, dim, top_k, cfg.n_rot, tuple(full[:n]))
    return cfg.replace(ext=icfg, n_group=1, n_group_used=1)


def load_attention(b: Any, p: str, layer: int) -> DSAWeights:
    """Block ``layer``'s MLA weights plus its indexer (``blk.N.indexer.*``) where present."""
    mla = b.mla(p)
    w = DSAWeights(**{f.name: getattr(mla, f.name) for f in fields(MLAWeights)})
    icfg: IndexerConfig = b.cfg.ext
    if p + "indexer.attn_k.weight" in b.r:
        w.indexer = IndexerWeights(b.lin(p + "indexer.attn_q_b", bias=False),
                                   b.lin(p + "indexer.attn_k", bias=False),
                                   b.vec(p + "indexer.k_norm.weight"),
                                   b.opt_vec(p + "indexer.k_norm.bias"),
                                   b.lin(p + "indexer.proj", bias=False))
        if w.indexer.wq_b.out_features != icfg.n_head * icfg.head_dim or \
                w.indexer.wk.out_features != icfg.head_dim:
            raise StoreError(f"{p}indexer tensors do not match attention.indexer.head_count "
                             f"{icfg.n_head} / key_length {icfg.head_dim}", path=b.r.path,
                             fix="the metadata and the tensors disagree; reconvert")
    elif layer < b.cfg.n_layers and icfg.full[layer]:
        raise StoreError(f"{p}indexer.attn_k.weight is missing on a full indexer layer",
                         path=b.r.path, fix="the store is not a complete glm-dsa model; "
                                            "repack it from the full GGUF")
    return w


class Attention:
    """The trunk's attention step: indexer selection (full layers), then sparse MLA."""

    def __init__(self, cfg: ModelConfig, cache: KVCache) -> None:
        self.icfg: IndexerConfig = cfg.ext
        add_key_cache(cache, self.icfg)
        self.sel = Selection()

    def __call__(self, x: torch.Tensor, w: DSAWeights, cfg: ModelConfig, rope: Rope,
                 cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                 mask: torch.Tensor | None) -> torch.Tensor:
        icfg = self.icfg

        def select(h: torch.Tensor, qr: torch.Tensor | None) -> torch.Tensor | None:
            if icfg.full[layer]:
                self.sel.idx = indexer_select(h, qr, w.indexer, icfg, cache, layer,
                                              lambda t: rope.apply(t, cos, sin))
            return self.sel.idx

        return mla_attention(x, w, cfg, rope, cos, sin, cache, layer, mask, select)
