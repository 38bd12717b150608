"""gpt-oss (gpt-oss-120b, gpt-oss-20b): llama.cpp's ``src/models/openai-moe.cpp`` from the parts.

Block: RMSNorm → grouped-query attention with q/k/v/output biases, NEOX RoPE (YaRN, its
correction range unrounded as transformers and OpenAI's reference compute it; llama.cpp rounds
it) and per-head sink logits that join the softmax and are dropped after it, over a sliding
window of ``attention.sliding_window`` positions on even layers and the whole context on odd ones
(the pattern has no GGUF key: llama.cpp's ``swa_pattern`` 2) → residual → RMSNorm
(``post_attention_norm``) → routed experts → residual. The router adds ``ffn_gate_inp.bias`` to
its logits, picks the top-k logits and softmaxes them (SOFTMAX_WEIGHT, no normalisation or
scale). Each expert carries its own biases (the ``ffn_{gate,up,down}_exps.bias`` rows the store
keeps as the expert's bias parts) and runs ``swiglu_oai``: alpha 1.702, limit 7.0, ``+1`` on up.

The stack, router and expert path are the generic ones; this module reads the window, loads the
sinks and biases and runs the attention step. A full layer keeps the whole context in its cache;
a sliding layer keeps a ring of ``memory.swa_ring`` positions (two windows: the window and as
many to roll back to), so its memory stays bounded at any context. A batch attends to the ring's
last ``window - 1`` positions and its own keys, then writes its keys into the ring. When the
ring is shorter than the context, ``memory.SWA_CHECKPOINTS`` copies of it are kept, each taken
one window after the end of a prefill (the position a later request sharing the prompt goes
back to); ``can_reset`` says whether a position can still be gone back to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ....errors import StoreError, UnsupportedModelError, UsageError
from ...memory import SWA_CHECKPOINTS, swa_ring
from ..attention import AttentionWeights, KVCache
from ..config import ModelConfig
from ..rope import Rope

__all__ = ["GptOssConfig", "SinkAttentionWeights", "Attention", "configure", "load_attention",
           "finish_block", "SWIGLU_ALPHA", "SWIGLU_LIMIT", "sliding"]

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0     # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
_SCORES = 1 << 24                           # float32 scores held at once by one batch's step


@dataclass(frozen=True)
class GptOssConfig:
    window: int                 # attention.sliding_window


@dataclass
class SinkAttentionWeights(AttentionWeights):
    sinks: torch.Tensor | None = None        # [n_head] float32 (attn_sinks)


def sliding(layer: int) -> bool:
    """Even layers slide (llama.cpp ``set_swa_pattern(2)``; transformers' ``layer_types``)."""
    return layer % 2 == 0


def configure(cfg: ModelConfig, get: Callable[..., Any], path: str | None) -> ModelConfig:
    window = int(get("attention.sliding_window", 0) or 0)
    if window < 1:
        raise UnsupportedModelError(
            f"gpt-oss: attention.sliding_window is {window}", path=path,
            fix="reconvert the model with llama.cpp's convert_hf_to_gguf.py (GptOssModel)")
    return cfg.replace(ext=GptOssConfig(window), yarn_truncate=False, norm_w=False, w_scale=0.0)


def load_attention(b: Any, p: str, layer: int) -> SinkAttentionWeights:
    cfg = b.cfg
    w = SinkAttentionWeights(b.lin(p + "attn_q"), b.lin(p + "attn_k"), b.lin(p + "attn_v"),
                             b.lin(p + "attn_output"))
    name = p + "attn_sinks.weight"
    if name not in b.r:
        raise StoreError(f"{name} is missing", path=b.r.path,
                         fix="the store is not a complete gpt-oss model; repack it from the "
                             "full GGUF")
    w.sinks = b.vec(name)
    if w.sinks.shape != (cfg.n_head,):
        raise StoreError(f"{name} has shape {tuple(w.sinks.shape)}, expected ({cfg.n_head},)",
                         path=b.r.path, fix="the metadata and the tensors disagree; reconvert")
    return w


def finish_block(b: Any, blk: Any) -> None:
    """The router's logit bias and the experts' ``swiglu_oai``."""
    if blk.moe is None:
        return
    name = f"blk.{blk.layer}.ffn_gate_inp.bias"
    blk.moe.router.bias = b.opt_vec(name)
    blk.moe.alpha, blk.moe.limit = SWIGLU_ALPHA, SWIGLU_LIMIT


@dataclass
class _Checkpoint:
    lo: int                            # it holds positions [lo, hi) of the rings
    hi: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]


class Attention:
    """Sink attention over the whole context (odd layers) or the sliding window (even)."""

    def __init__(self, cfg: ModelConfig, cache: KVCache) -> None:
        self.window = cfg.ext.window
        self.layers = [i for i in range(len(cache.k)) if sliding(i) and cache.k[i] is not None]
        self.ring = swa_ring(self.window, cache.n_ctx)
        cache.ring(self.layers, self.ring)
        self.lo = 0                        # the rings hold positions [lo, cache.pos)
        self.origin: int | None = 0        # the last prompt's end, until its checkpoint
        self.ckpts: list[_Checkpoint] = []
        if cache.n_ctx > self.ring and self.layers:
            self.ckpts = [_Checkpoint(0, 0, [cache.k[i].clone() for i in self.layers],
                                      [cache.v[i].clone() for i in self.layers])
                          for _ in range(SWA_CHECKPOINTS)]
            cache.state_bytes += sum(t.numel() * t.element_size() for c in self.ckpts
                                     for t in c.k + c.v)
        self.cache = cache

    def _covers(self, lo: int, hi: int, pos: int) -> bool:
        return lo <= max(0, pos - self.window + 1) and pos <= hi

    def can_reset(self, pos: int, cur: int) -> bool:
        """Can the rings go back to ``pos`` from ``cur`` (the window before ``pos`` is held)?"""
        return pos >= cur or pos == 0 or self._covers(self.lo, cur, pos) or \
            any(self._covers(c.lo, c.hi, pos) for c in self.ckpts)

    def reset(self, pos: int, cur: int) -> None:
        if pos >= cur:
            return
        self.origin = pos
        if pos == 0:
            self.lo = 0
        elif not self._covers(self.lo, cur, pos):
            c = next((c for c in self.ckpts if self._covers(c.lo, c.hi, pos)), None)
            if c is None:
                raise UsageError(f"gpt-oss: the sliding-window layers cannot go back from "
                                 f"position {cur} to {pos} (they keep the last {self.ring} "
                                 "positions and checkpoints after recent prompts)",
                                 fix="reset to 0 and prefill the tokens again")
            for i, kc, vc in zip(self.layers, c.k, c.v):
                self.cache.k[i].copy_(kc)
                self.cache.v[i].copy_(vc)
            self.lo = c.lo
        for c in self.ckpts:
            c.hi = min(c.hi, pos)

    def _step_done(self, p0: int, T: int) -> None:
        """After the last sliding layer's write: the end of a prefill, or its checkpoint."""
        end = p0 + T
        if T > 1:
            self.origin = end
        elif self.origin is not None and end >= self.origin + self.ring - self.window:
            self.origin = None
            if self.ckpts:
                c = min(self.ckpts, key=lambda c: c.hi)
                for i, kc, vc in zip(self.layers, c.k, c.v):
                    kc.copy_(self.cache.k[i])
                    vc.copy_(self.cache.v[i])
                c.lo, c.hi = self.lo, end

    def _ring_keys(self, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   p0: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Keys and values of positions ``base .. p0+T-1`` (the window before ``p0`` from the
        ring, then this batch's), and this batch's written into the ring."""
        T, R = k.shape[0], self.ring
        if layer == self.layers[0]:
            self.lo = max(self.lo, p0 + T - R)
        base = max(0, p0 - self.window + 1)
        old = torch.arange(base, p0, device=kc.device) % R
        kt, vt = k.transpose(0, 1).to(kc.dtype), v.transpose(0, 1).to(vc.dtype)
        kk = torch.cat((kc.index_select(1, old), kt), dim=1)
        vv = torch.cat((vc.index_select(1, old), vt), dim=1)
        m = min(T, R)
        slots = torch.arange(p0 + T - m, p0 + T, device=kc.device) % R
        kc.index_copy_(1, slots, kt[:, T - m:])
        vc.index_copy_(1, slots, vt[:, T - m:])
        if layer == self.layers[-1]:
            self._step_done(p0, T)
        return kk, vv, base

    def __call__(self, x: torch.Tensor, w: SinkAttentionWeights, cfg: ModelConfig, rope: Rope,
                 cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                 mask: torch.Tensor | None) -> torch.Tensor:
        T = x.shape[0]
        H, K, D, Dv = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.v_head_dim
        q = rope.norm_apply(w.wq(x).view(T, H, D), None, cfg.rms_eps, cos, sin)
        k = rope.norm_apply(w.wk(x).view(T, K, D), None, cfg.rms_eps, cos, sin)
        v = w.wv(x).view(T, K, Dv)
        p0 = cache.pos
        kc, vc = cache.k[layer], cache.v[layer]
        win = self.window if sliding(layer) else 0
        if win:
            kc, vc, base = self._ring_keys(k, v, kc, vc, p0, layer)
        else:
            kc[:, p0:p0 + T] = k.transpose(0, 1)
            vc[:, p0:p0 + T] = v.transpose(0, 1)
            base = 0
        G = H // K
        qg = q.float().view(T, K, G, D).permute(1, 2, 0, 3)            # [K, G, T, D]
        sinks = w.sinks.to(x.device, torch.float32).view(K, G, 1, 1)
        out = torch.empty(K, G, T, Dv, dtype=torch.float32, device=x.device)
        S = p0 + T - base
        step = max(1, _SCORES // max(1, H * S))
        for a in range(0, T, step):                                    # bounded score memory
            b = min(T, a + step)
            lo = max(base, p0 + a - win + 1) if win else 0             # first key any row sees
            hi = p0 + b
            kk = kc[:, lo - base:hi - base].float()                    # [K, S', D]
            vv = vc[:, lo - base:hi - base].float()
            s = torch.einsum("kgtd,ksd->kgts", qg[:, :, a:b], kk) * cfg.kq_scale
            qpos = torch.arange(p0 + a, hi, device=x.device)[:, None]
            kpos = torch.arange(lo, hi, device=x.device)[None, :]
            keep = kpos <= qpos
            if win:
                keep &= qpos - kpos < win
            s = s.masked_fill(~keep, float("-inf"))
            s = torch.cat((s, sinks.expand(K, G, b - a, 1)), dim=-1)
            pr = torch.softmax(s, dim=-1)[..., :-1]                    # the sink is dropped
            out[:, :, a:b] = torch.einsum("kgts,ksd->kgtd", pr, vv)
        o = out.permute(2, 0, 1, 3).reshape(T, H * Dv).to(x.dtype)
        return w.wo(o)
