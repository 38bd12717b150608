"""A router with hooks: routing taps (for the draft-route predictor) and the opt-in route tail
skip.

``RouterHook`` replaces the expert runner's ``Router`` (same selection, llama.cpp semantics) and
knows each ``RouterWeights``' layer. After each routing decision it can

* **tail-skip** (``--route-tail-skip N``, lossy, off by default): inside a decode or verify
  window (``in_window()``: the engine's ``runner.decoding``), an expert of this layer that is
  not resident (not in a cache tier, not loading, not in the dequantized cache) and ranks past
  N — by routing weight — for *every* token of the window is neither fetched nor computed. A one-token window drops its
  pairs; in a wider window they are pointed at the token's first-ranked expert with weight 0
  (the runner fetches each expert once per batch, so nothing new is read and nothing added;
  the runner's interface has no per-pair mask). Every other pair keeps its routing weight (no
  renormalisation). With N >= k nothing is skipped. Prefill and the NextN block are never
  skipped;
* **tap**: hand ``(layer, x, ids, weights)`` to every callable in ``taps`` (what the verify pass
  routed, for the predictor's online calibration and for evaluations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..experts.protocol import TierState
from ..model.router import Router, RouterWeights

__all__ = ["RouterHook", "SkipStats", "resident_fn"]


@dataclass
class SkipStats:
    windows: int = 0             # layer × window routings seen under the skip
    pairs: int = 0               # token × expert pairs routed in those windows
    skipped_pairs: int = 0
    skipped_experts: int = 0     # distinct experts not fetched (per layer and window)
    skipped_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["skipped_pair_share"] = round(self.skipped_pairs / self.pairs, 4) if self.pairs else 0.0
        return d


def resident_fn(provider: Any, dq: Any) -> Callable[[int, int], bool]:
    """``(layer, expert) -> bool``: in a provider tier, loading, or in the dequantized cache."""
    tiers = provider if isinstance(provider, TierState) else None
    kept = dq if dq is not None and dq.enabled else None

    def resident(layer: int, e: int) -> bool:
        if kept is not None and (layer, e) in kept:
            return True
        if tiers is None:
            return False
        try:
            return tiers.is_resident(layer, e)
        except Exception:                                                # not a routed layer
            return True
    return resident


class RouterHook(Router):
    def __init__(self, base: Router, layer_of: dict[int, int], *, skip_n: int = 0,
                 resident: Callable[[int, int], bool] | None = None,
                 skip_layers: set[int] | None = None,
                 expert_bytes: Callable[[int, int], int] | None = None,
                 in_window: Callable[[], bool] | None = None) -> None:
        self.__dict__.update(base.__dict__)          # the same gating, k, groups, scaling
        self.layer_of = layer_of                     # id(RouterWeights) -> layer
        self.skip_n = int(skip_n)
        self.resident = resident or (lambda layer, e: False)
        self.skip_layers = skip_layers               # None: every layer
        self.expert_bytes = expert_bytes or (lambda layer, e: 0)
        self.in_window = in_window or (lambda: False)    # a decode or verify forward runs
        self.taps: list[Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]] = []
        self.skip = SkipStats()

    def __call__(self, x: torch.Tensor, w: RouterWeights
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids, wts, probs = super().__call__(x, w)
        layer = self.layer_of.get(id(w), -1)
        if (self.skip_n and self.skip_n < ids.shape[1] and self.in_window() and
                (self.skip_layers is None or layer in self.skip_layers)):
            ids, wts = self._tail_skip(layer, ids, wts)
        for tap in self.taps:
            tap(layer, x, ids, wts)
        return ids, wts, probs

    def _tail_skip(self, layer: int, ids: torch.Tensor, wts: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        T, k = ids.shape
        order = torch.argsort(wts, dim=1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(k, device=ids.device)
                                                .expand(T, k).contiguous())
        ih, rh = ids.tolist(), rank.tolist()
        head: set[int] = set()
        tail: set[int] = set()
        for row_i, row_r in zip(ih, rh):
            for e, r in zip(row_i, row_r):
                (head if r < self.skip_n else tail).add(e)
        st = self.skip
        st.windows += 1
        st.pairs += T * k
        drop = {e for e in tail - head if not self.resident(layer, e)}
        if not drop:
            return ids, wts
        first = ids.gather(1, order[:, :1])                             # [T, 1] rank-0 expert
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for e in drop:
            mask |= ids == e
        st.skipped_pairs += int(mask.sum())
        st.skipped_experts += len(drop)
        st.skipped_bytes += sum(self.expert_bytes(layer, e) for e in drop)
        if T == 1:                                   # one token: drop the pairs outright
            keep = ~mask[0]
            return ids[:, keep], wts[:, keep]
        ids = torch.where(mask, first.expand(T, k), ids)
        wts = wts.masked_fill(mask, 0.0)
        return ids, wts
