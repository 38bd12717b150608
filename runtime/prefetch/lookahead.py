"""Next-layer gate lookahead: predict layer L+1's experts while layer L runs, and score it.

At layer L's MoE step the residual stream ``h`` (the FFN input) is normalised with layer
L+1's own FFN norm and fed to layer L+1's router; its top ``k + margin`` experts per token are
handed to ``provider.prefetch(L+1, ...)`` once layer L's own reads are issued; the cache reads
them one at a time when no demand read is in flight, so they overlap layer L's compute and layer
L+1's attention, and drops those still queued when layer L+1 routes. When layer L+1 actually routes, the
prediction is scored per forward step (the union over the batch's tokens):

- coverage = |predicted ∩ used| / |used|   (share of needed experts that were prefetched)
- waste    = |predicted \\ used| / |predicted|   (share of prefetches nobody asked for)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LookaheadStats"]


@dataclass
class LookaheadStats:
    margin: int = 2
    predicted: int = 0           # experts prefetched (union per layer step)
    used: int = 0                # experts the layers then asked for
    hits: int = 0                # predicted and used
    per_layer: dict[int, list[int]] = field(default_factory=dict)   # layer → [pred, used, hits]
    _pending: dict[int, set[int]] = field(default_factory=dict, repr=False)

    def predict(self, layer: int, experts: set[int]) -> None:
        self._pending[layer] = experts

    def score(self, layer: int, used: set[int]) -> None:
        pred = self._pending.pop(layer, None)
        if pred is None:
            return
        h = len(pred & used)
        self.predicted += len(pred)
        self.used += len(used)
        self.hits += h
        row = self.per_layer.setdefault(layer, [0, 0, 0])
        row[0] += len(pred)
        row[1] += len(used)
        row[2] += h

    def reset_pending(self) -> None:
        self._pending.clear()

    @property
    def coverage(self) -> float:
        return self.hits / self.used if self.used else 0.0

    @property
    def waste(self) -> float:
        return (self.predicted - self.hits) / self.predicted if self.predicted else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"margin": self.margin, "predicted": self.predicted, "used": self.used,
                "hits": self.hits, "coverage": round(self.coverage, 4),
                "waste": round(self.waste, 4)}
