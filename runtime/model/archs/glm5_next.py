"""glm5-next (GLM-5.3-Flash): llama.cpp's ``src/models/glm5-next.cpp`` from the layer kinds.

The residual is ``hyper_connection.count`` mHC streams (``mhc``): expanded from the embedding,
each block's attention and FFN wrapped by ``hc_block`` (their own ``hc_attn_*``/``hc_ffn_*``
mixes; the block's RMSNorm inside), collapsed by their mean before the output norm. Attention
per layer from ``attention.head_count_kv`` (an array of block_count: 0 = KDA linear attention,
``kda``; 1 = MLA): nope-only MLA (``rope.dimension_count`` 0, absorbed ``attn_k_b``/``attn_v_b``,
a cache of the latent only) over the k-pool DSA indexer's selection (``indexer.kpool_select``;
``attention.indexer.types``, one bool per trunk layer, true = full; a shared layer reuses the
selection of the last full layer, kept across the KDA layers in between as llama.cpp does —
transformers only hands it on from the layer just before). FFN: SwiGLU on the leading dense
blocks, else the sigmoid router (``exp_probs_b``, normalised top-k, ``expert_weights_scale``)
+ one shared expert, with ``swiglu_clamp_exp``/``swiglu_clamp_shexp`` (arrays of block_count;
the dense blocks use the shexp clamp, as llama.cpp's ``build_ffn`` does).

The NextN block(s) (``block_count`` includes them) are MLA blocks with their own experts and no
hc tensors, run by ``mtp.nextn`` as dense MLA (llama.cpp has no glm5-next MTP graph).

KDA state and rollback: the conv windows and recurrent states (``kda.KDAState``) are the state of
the last position only. ``Model.reset(pos)`` restores it where it can: to 0, to the current
position, or to a position inside the last decode window (an MTP verify pass: those forwards
run the KDA layers token by token and keep each position's state); any other earlier position
is a typed ``UsageError``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from ....errors import StoreError, UnsupportedModelError, UsageError
from ..attention import KVCache
from ..config import ModelConfig
from ..indexer import IndexerConfig, KPoolWeights, Selection, add_kpool_cache, kpool_select
from ..kda import KDA_TENSORS, KDAConfig, KDAState, KDAWeights, kda_attention
from ..mhc import HC_TENSORS, HCConfig, HCWeights, hc_block, hc_collapse, hc_expand
from ..mla import MLAWeights, mla_attention
from ..rope import Rope, rms_norm
from .glm_dsa import DSAWeights

__all__ = ["G5Config", "G5Layer", "Attention", "configure", "load_attention", "finish_block",
           "forward_blocks", "kda_layers"]

_MATRICES = ("wq", "wk", "wv", "f_a", "f_b", "beta", "g_a", "g_b", "wo")
_KDA_NAMES = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output"}


@dataclass(frozen=True)
class G5Config:
    mla: tuple[bool, ...]            # per trunk layer: MLA (True) or KDA (False)
    indexer: IndexerConfig           # its ``full`` covers the trunk layers
    kda: KDAConfig
    hc: HCConfig
    clamp_exp: tuple[float, ...]     # per block (NextN included); 0 = none
    clamp_shexp: tuple[float, ...]


@dataclass
class G5Layer:
    """A trunk block's attention (KDA or MLA + k-pool indexer) and its two mHC mixes."""

    attn: KDAWeights | DSAWeights
    hc_attn: HCWeights
    hc_ffn: HCWeights


def kda_layers(cfg: ModelConfig) -> list[int]:
    return [i for i, m in enumerate(cfg.ext.mla) if not m]


def _list(v: Any) -> list | None:
    if v is None:
        return None
    v = v.tolist() if hasattr(v, "tolist") else v
    return list(v) if isinstance(v, (list, tuple)) else None


def configure(cfg: ModelConfig, get: Callable[..., Any], path: str | None) -> ModelConfig:
    def bad(problem: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"glm5-next: {problem}", path=path,
                                     fix="reconvert the model with llama.cpp's "
                                         "convert_hf_to_gguf.py (Glm5NextModel)")

    def need(key: str) -> Any:
        v = get(key)
        if v is None:
            raise bad(f"metadata key {key} is missing")
        return v

    n, nb = cfg.n_layers, cfg.n_block
    kinds = _list(need("attention.head_count_kv"))
    if kinds is None or len(kinds) != nb:
        raise bad(f"attention.head_count_kv must be an array of block_count {nb} entries "
                  f"(0 = KDA, 1 = MLA), not {kinds if kinds is None else len(kinds)}")
    mla = tuple(int(k) != 0 for k in kinds[:n])
    if cfg.n_rot:
        raise bad(f"rope.dimension_count is {cfg.n_rot}; glm5-next's MLA has no RoPE (0)")
    if not cfg.q_lora_rank or cfg.head_dim != cfg.kv_lora_rank:
        raise bad(f"attention.key_length {cfg.head_dim} is not the latent width kv_lora_rank "
                  f"{cfg.kv_lora_rank}, or no q_lora_rank")

    def per_block(key: str, default: list[float] | None) -> tuple[float, ...]:
        v = get(key)
        if v is None:
            return tuple(default) if default is not None else (0.0,) * nb
        vals = _list(v)
        vals = [float(v)] * nb if vals is None else [float(x) for x in vals]
        if len(vals) != nb:
            raise bad(f"{key} has {len(vals)} entries for block_count {nb}")
        return tuple(vals)

    clamp_exp = per_block("swiglu_clamp_exp", None)
    clamp_shexp = per_block("swiglu_clamp_shexp", list(clamp_exp))

    heads, dim, top_k, kpool = (int(need(f"attention.indexer.{k}"))
                                for k in ("head_count", "key_length", "top_k", "kpool"))
    if heads < 1 or dim < 1 or kpool < 2 or top_k % kpool or dim % kpool:
        raise bad(f"attention.indexer.head_count/key_length/top_k/kpool are "
                  f"{heads}/{dim}/{top_k}/{kpool} (kpool > 1 must divide top_k and key_length)")
    types = _list(get("attention.indexer.types"))
    full = [True] * n if types is None else [bool(t) for t in types]
    if len(full) != n:
        raise bad(f"attention.indexer.types has {len(full)} entries for {n} layers")
    first = next((i for i in range(n) if mla[i]), None)
    if first is not None and not full[first]:
        raise bad(f"the first MLA layer's ({first}) indexer is 'shared' (a shared layer needs "
                  "a full one before it)")
    full = [f and m for f, m in zip(full, mla)]
    icfg = IndexerConfig(heads, dim, top_k, 0, tuple(full),
                         k_norm_eps=float(get("attention.layer_norm_epsilon", 1e-6) or 0.0),
                         kpool=kpool, select_tail=bool(get("attention.indexer.kpool_select_tail",
                                                           False)))
    lb = get("kda.gate_lower_bound")
    kcfg = KDAConfig(cfg.n_head, int(need("kda.head_dim")), int(need("ssm.conv_kernel")),
                     None if lb is None else float(lb), cfg.rms_eps)
    hcfg = HCConfig(int(need("hyper_connection.count")),
                    int(need("hyper_connection.sinkhorn_iterations")),
                    float(need("hyper_connection.epsilon")), cfg.rms_eps)
    if hcfg.n_streams < 1 or hcfg.sinkhorn_iters < 1:
        raise bad(f"hyper_connection.count {hcfg.n_streams} / sinkhorn_iterations "
                  f"{hcfg.sinkhorn_iters}")
    ext = G5Config(mla, icfg, kcfg, hcfg, clamp_exp, clamp_shexp)
    return cfg.replace(ext=ext, n_group=1, n_group_used=1)


def _mla(b: Any, p: str, layer: int) -> DSAWeights:
    m = b.mla(p)
    w = DSAWeights(**{f.name: getattr(m, f.name) for f in fields(MLAWeights)})
    icfg: IndexerConfig = b.cfg.ext.indexer
    if p + "indexer.attn_k.weight" in b.r:
        w.indexer = KPoolWeights(b.lin(p + "indexer.attn_q_b", bias=False),
                                 b.lin(p + "indexer.attn_k", bias=False),
                                 b.vec(p + "indexer.k_norm.weight"),
                                 b.opt_vec(p + "indexer.k_norm.bias"),
                                 b.lin(p + "indexer.proj", bias=False),
                                 b.lin(p + "indexer_compressor_gate", bias=False),
                                 b.vec(p + "indexer_compressor_ape.weight"))
        ix = w.indexer
        if ix.wq_b.out_features != icfg.n_head * icfg.head_dim or \
                ix.wk.out_features != icfg.head_dim or \
                tuple(ix.ape.shape) != (icfg.kpool, icfg.head_dim):
            raise StoreError(f"{p}indexer tensors do not match attention.indexer.head_count "
                             f"{icfg.n_head} / key_length {icfg.head_dim} / kpool {icfg.kpool}",
                             path=b.r.path, fix="the metadata and the tensors disagree; reconvert")
    elif layer < b.cfg.n_layers and icfg.full[layer]:
        raise StoreError(f"{p}indexer.attn_k.weight is missing on a full indexer layer",
                         path=b.r.path, fix="the store is not a complete glm5-next model; "
                                            "repack it from the full GGUF")
    return w


def _kda(b: Any, p: str) -> KDAWeights:
    args = {}
    for name, gguf in KDA_TENSORS.items():
        if name in _MATRICES:
            args[name] = b.lin(p + gguf[:-len(".weight")], bias=False)
        else:
            args[name] = b.vec(p + gguf)
    return KDAWeights(**args)


def load_attention(b: Any, p: str, layer: int) -> G5Layer | DSAWeights:
    """A trunk block's ``G5Layer``; a NextN block's MLA (no hc tensors, a full indexer)."""
    g: G5Config = b.cfg.ext
    if layer >= b.cfg.n_layers:
        return _mla(b, p, layer)
    attn = _mla(b, p, layer) if g.mla[layer] else _kda(b, p)
    hc = [HCWeights(*(b.vec(p + n) for n in HC_TENSORS[k])) for k in ("attn", "ffn")]
    return G5Layer(attn, *hc)


def finish_block(b: Any, blk: Any) -> None:
    """The block's swiglu clamps (the dense blocks and the shared expert use the shexp one)."""
    g: G5Config = b.cfg.ext
    i = blk.layer
    if blk.dense is not None:
        blk.dense.limit = g.clamp_shexp[i]
    if blk.moe is not None:
        blk.moe.limit = g.clamp_exp[i]
        if blk.moe.shared is not None:
            blk.moe.shared.limit = g.clamp_shexp[i]


class Attention:
    """The attention step of either kind, the KDA state and its rollback checkpoints."""

    def __init__(self, cfg: ModelConfig, cache: KVCache) -> None:
        g: G5Config = cfg.ext
        self.g, self.icfg = g, g.indexer
        kda = kda_layers(cfg)
        cache.drop(kda)
        add_kpool_cache(cache, self.icfg)
        self.state = KDAState(g.kda, kda, cache.device)
        cache.state_bytes = self.state.nbytes
        self.sel = Selection()
        self.window = False                  # this forward keeps each position's KDA state
        self.p0 = 0
        self.ckpt: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def begin(self, p0: int, T: int, decoding: bool) -> None:
        """A forward of ``T`` positions from ``p0``; a decode window keeps each one's state."""
        self.p0, self.window = p0, decoding and T > 1
        self.ckpt = {}

    def can_reset(self, pos: int, cur: int) -> bool:
        """Can the KDA state go back to ``pos`` from ``cur`` (see ``reset``)?"""
        return pos >= cur or pos == 0 or pos in self.ckpt

    def reset(self, pos: int, cur: int) -> None:
        if pos >= cur:
            return
        if pos == 0:
            self.state.reset()
        elif pos in self.ckpt:
            for il, (conv, ssm) in self.ckpt[pos].items():
                self.state.conv[il].copy_(conv)
                self.state.ssm[il].copy_(ssm)
        else:
            raise UsageError(f"glm5-next: the KDA layers' recurrent state cannot roll back from "
                             f"position {cur} to {pos} (it is kept for the last decode window "
                             "only)", fix="reset to 0 and prefill the tokens again")
        self.ckpt = {p: c for p, c in self.ckpt.items() if p < pos}

    def _kda(self, x: torch.Tensor, w: KDAWeights, layer: int) -> torch.Tensor:
        st = self.state
        if not self.window:
            return kda_attention(x, w, self.g.kda, st, layer)
        outs = []
        for t in range(x.shape[0]):
            outs.append(kda_attention(x[t:t + 1], w, self.g.kda, st, layer))
            self.ckpt.setdefault(self.p0 + t + 1, {})[layer] = (st.conv[layer].clone(),
                                                               st.ssm[layer].clone())
        return torch.cat(outs)

    def __call__(self, x: torch.Tensor, w: KDAWeights | DSAWeights, cfg: ModelConfig,
                 rope: Rope, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                 mask: torch.Tensor | None) -> torch.Tensor:
        if isinstance(w, KDAWeights):
            return self._kda(x, w, layer)
        icfg = self.icfg

        def select(h: torch.Tensor, qr: torch.Tensor | None) -> torch.Tensor | None:
            if icfg.full[layer]:
                self.sel.idx = kpool_select(h, qr, w.indexer, icfg, cache, layer)
            return self.sel.idx

        return mla_attention(x, w, cfg, rope, cos, sin, cache, layer, mask, select)


def forward_blocks(m: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """The trunk over ``x [T, D]`` (the embedding, float32) → the collapsed streams ``[T, D]``."""
    cfg, att = m.cfg, m.attend
    g: G5Config = cfg.ext
    att.begin(m.cache.pos, x.shape[0], m.runner.decoding)
    s = hc_expand(x, g.hc.n_streams)
    for blk in m.trunk.blocks:
        L, w = blk.layer, blk.attn

        def attn(h: torch.Tensor) -> torch.Tensor:
            h = rms_norm(h, blk.attn_norm, cfg.rms_eps).to(m.dtype)
            return att(h, w.attn, cfg, m.rope, cos, sin, m.cache, L, mask).float()

        def ffn(h: torch.Tensor) -> torch.Tensor:
            pred = m.predict_next(L, h)       # the next layer's router on this FFN's input
            return m.ffn(L, blk, rms_norm(h, blk.ffn_norm, cfg.rms_eps).to(m.dtype), pred).float()

        s = hc_block(s, w.hc_attn, g.hc, attn)
        s = hc_block(s, w.hc_ffn, g.hc, ffn)
    return hc_collapse(s)
