"""Expert selection exactly as llama.cpp's ``build_moe_ffn`` does it (LC src/llama-graph.cpp).

::

    logits = W_gate_inp @ x (+ ffn_gate_inp.bias)   float32, [T, E]
    probs  = softmax(logits) | sigmoid(logits) | logits (SOFTMAX_WEIGHT)
    sel    = probs + exp_probs_b                    the bias chooses, it never weighs
    groups (n_group > 1): score = sum of the top-2 sel per group; keep the best n_group_used
           groups, the others' sel become -inf
    ids    = top-k(sel)
    w      = probs[ids]                             unbiased
    SOFTMAX_WEIGHT: w = softmax(w);  norm_w: w /= clamp(sum(w), 6.103515625e-5);  w *= w_scale

Everything stays on the device: no host synchronisation here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels as native
from ..kernels import gemm
from .config import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT, ModelConfig

__all__ = ["Router", "RouterWeights"]

W_SUM_MIN = 6.103515625e-5       # llama.cpp's clamp of the weight sum (2**-14)


@dataclass
class RouterWeights:
    weight: torch.Tensor             # [E, n_embd] float32
    probs_bias: torch.Tensor | None  # [E] float32 (exp_probs_b)
    bias: torch.Tensor | None = None  # [E] float32 added to the logits (gpt-oss ffn_gate_inp.bias)


class Router:
    def __init__(self, cfg: ModelConfig, k: int | None = None) -> None:
        self.gating, self.norm_w, self.w_scale = cfg.gating, cfg.norm_w, cfg.w_scale
        self.k = k or cfg.n_expert_used
        self.n_group, self.n_group_used = cfg.n_group, cfg.n_group_used
        self.native = self.gating in (GATING_SOFTMAX, GATING_SIGMOID)

    def _native(self, x: torch.Tensor, w: RouterWeights, k: int) -> tuple[int, int] | None:
        """(n_group, n_group_used) of one token's native choice of ``k``, (1, 1) without a
        group limit; None where the native call does not apply."""
        if not self.native or x.shape[0] != 1 or w.bias is not None:
            return None
        if self.n_group <= 1:
            return 1, 1
        E, G = w.weight.shape[0], self.n_group
        if E % G or E // G < 2 or not 1 <= self.n_group_used <= G \
                or k > self.n_group_used * (E // G):
            return None
        return G, self.n_group_used

    def probs(self, x: torch.Tensor, w: RouterWeights) -> torch.Tensor:
        logits = gemm.linear(x.float(), w.weight, w.bias)            # [T, E]
        if self.gating == GATING_SOFTMAX:
            return logits.softmax(-1)
        if self.gating == GATING_SIGMOID:
            return logits.sigmoid()
        if self.gating == GATING_SOFTMAX_WEIGHT:
            return logits
        raise ValueError(f"expert gating function {self.gating}")

    def select(self, probs: torch.Tensor, w: RouterWeights, k: int | None = None) -> torch.Tensor:
        """Top-``k`` expert ids ``[T, k]`` (int64) from ``probs`` with the selection bias."""
        sel = probs if w.probs_bias is None else probs + w.probs_bias
        if self.n_group > 1:
            T, E = sel.shape
            g = sel.view(T, self.n_group, E // self.n_group)
            score = g.topk(2, dim=-1).values.sum(-1)              # [T, G]
            keep = score.topk(self.n_group_used, dim=-1).indices   # [T, Gu]
            mask = torch.ones_like(score, dtype=torch.bool).scatter_(1, keep, False)
            sel = g.masked_fill(mask[..., None], float("-inf")).view(T, E)
        return sel.topk(k or self.k, dim=-1).indices

    def top(self, x: torch.Tensor, w: RouterWeights, k: int) -> torch.Tensor:
        """The top-``k`` ids ``[T, k]`` best first, without their weights (a guess of the
        choice: the lookahead's); one token's from one native call where the kernels take it."""
        groups = self._native(x, w, k)
        if groups is not None:
            r = native.route(x, w.weight, w.probs_bias, k, self.gating == GATING_SIGMOID,
                             False, W_SUM_MIN, 1.0, *groups)
            if r is not None:
                return r[0]
        return self.select(self.probs(x, w), w, k)

    def __call__(self, x: torch.Tensor, w: RouterWeights
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x [T, n_embd]`` → ``(ids [T, k] int64, weights [T, k] float32, probs [T, E])``;
        one token's choice comes from one native call where the kernels take it (probs None)."""
        groups = self._native(x, w, self.k)
        if groups is not None:
            r = native.route(x, w.weight, w.probs_bias, self.k, self.gating == GATING_SIGMOID,
                             self.norm_w, W_SUM_MIN, self.w_scale or 1.0, *groups)
            if r is not None:
                return r[0], r[1], None
        probs = self.probs(x, w)
        ids = self.select(probs, w)
        wts = probs.gather(1, ids)
        if self.gating == GATING_SOFTMAX_WEIGHT:
            wts = wts.softmax(-1)
        if self.norm_w:
            wts = wts / wts.sum(-1, keepdim=True).clamp_min(W_SUM_MIN)
        if self.w_scale and self.w_scale != 1.0:
            wts = wts * self.w_scale
        return ids, wts, probs
