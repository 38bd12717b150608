"""Next-layer gate lookahead: predict layer L+1's experts while layer L runs, and score it.

At layer L's MoE step the residual stream ``h`` (the FFN input) is normalised with layer
L+1's own FFN norm and fed to layer L+1's router; its top ``k + margin`` experts per token are
handed to ``provider.prefetch(L+1, ...)`` once layer L's own reads are issued; the cache reads
them one at a time when no demand read is in flight, so they overlap layer L's compute and layer
L+1's attention, and drops those still queued when layer L+1 routes. When layer L+1 actually routes, the
prediction is scored per forward step (the union over the batch's tokens), as a
``PredictionScore`` (timing not scored):

- coverage = |predicted ∩ used| / |used|   (share of needed experts that were prefetched)
- waste    = |predicted \\ used| / |predicted|   (share of prefetches nobody asked for)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .score import PredictionScore

__all__ = ["AUTO_ARCHS", "AUTO_MARGIN", "MARGIN", "LookaheadStats", "auto_lookahead",
           "lookahead_slots"]

#: Architectures whose experts the lookahead predicts and reads early enough to gain while
#: they stream, so ``run``/``serve`` turn it on there without a trial: glm5-next's mHC streams
#: change little from one layer to the next, so layer L+1's router on layer L's FFN input finds
#: most of its route, and its layers wait on the drive (bench/README.md, "The lookahead on
#: GLM-5.3-Flash"; its trials there were inside their margin, so a trial only cost its off
#: epochs: "The lookahead tuned per run"); elsewhere each run tries it (``prefetch.tuner``)
AUTO_ARCHS = ("glm5-next",)
#: experts beyond top-k a token's lookahead prefetches (``--lookahead``) ...
MARGIN = 2
#: ... and where it is on by default: predictions beyond top-k were more wasted reads than hits
AUTO_MARGIN = 0


def auto_lookahead(arch: str, tier_experts: int, n_experts: int, vram: bool,
                   trunk_resident: bool) -> str:
    """The lookahead's default (``--lookahead auto``): ``"off"`` unless the experts stream (a
    RAM tier of ``tier_experts`` holds fewer than the ``n_experts`` a decode routes among, no
    VRAM tier, the trunk resident: where the trunk is re-read every token its reads are the
    drive's work, and the guesses' reads slowed it), then ``"on"`` for ``AUTO_ARCHS`` and
    ``"tuned"`` elsewhere (``prefetch.tuner``: tried on and off in decode, the faster kept,
    starting off). ``run``/``serve`` and ``plan`` both read it."""
    if tier_experts >= n_experts or vram or not trunk_resident:
        return "off"
    return "on" if arch in AUTO_ARCHS else "tuned"


@dataclass
class LookaheadStats:
    margin: int = 2
    score: PredictionScore = field(default_factory=PredictionScore)     # all layers
    per_layer: dict[int, PredictionScore] = field(default_factory=dict)
    _pending: dict[int, set[int]] = field(default_factory=dict, repr=False)

    def predict(self, layer: int, experts: set[int]) -> None:
        self._pending[layer] = experts

    def on_route(self, layer: int, used: set[int]) -> None:
        pred = self._pending.pop(layer, None)
        if pred is None:
            return
        self.score.add(pred, used)
        self.per_layer.setdefault(layer, PredictionScore()).add(pred, used)

    def reset_pending(self) -> None:
        self._pending.clear()

    def as_dict(self) -> dict[str, Any]:
        sc = self.score
        return {"margin": self.margin, "predicted": sc.predicted, "used": sc.needed,
                "hits": sc.hits, **sc.ratios("coverage", "waste", digits=4)}


def lookahead_slots(store: Any, options: Any) -> int:
    """RAM slots for the lookahead's staged prefetches: ``options.prefetch_slots``, by default
    one layer's predictions (k + margin) and one more for the previous layer's read still in
    flight (predictions are read one at a time, and those still queued when their layer runs
    are dropped). Every slot here is one the RAM tier does not get. (``options``: the
    engine's ``EngineOptions``.)"""
    if options.prefetch_slots is not None:
        return max(0, int(options.prefetch_slots))
    k = int((getattr(store, "summary", {}) or {}).get("expert_used_count") or 1)
    return k + max(0, options.lookahead_margin) + 1
