"""Score a predictor on a routing trace, offline and exactly: recall and precision per layer visit.

For each row of the trace (a token at a layer), in execution order, the predictor has already
seen every earlier row and was asked for that layer's experts right after the previous row (one
layer of lookahead, as the runtime asks it). Recall: the share of the route it predicted;
precision: the share of its predictions that the route used. No cache and no timing here: how
much of that turns into hits in time is measured on the real provider (``Prefetcher`` stats).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..trace.file import TraceChunk, TraceHeader

__all__ = ["PredictorScore", "evaluate_predictor", "trace_rows"]


@dataclass
class PredictorScore:
    rows: int = 0
    requested: int = 0
    predicted: int = 0
    hits: int = 0
    per_layer_hits: dict[int, int] = field(default_factory=dict)
    per_layer_requested: dict[int, int] = field(default_factory=dict)

    @property
    def recall(self) -> float:
        return self.hits / self.requested if self.requested else 0.0

    @property
    def precision(self) -> float:
        return self.hits / self.predicted if self.predicted else 0.0


def trace_rows(chunks: Iterable[TraceChunk]) -> Iterable[tuple[int, int, list[int]]]:
    """(token, layer, experts) per row, in file order."""
    for c in chunks:
        for t, la, ex in zip(c.tokens.tolist(), c.layers.tolist(), c.experts.tolist()):
            yield t, la, ex


def evaluate_predictor(predictor: Any, header: TraceHeader, chunks: Iterable[TraceChunk], *,
                       budget: int | None = None, skip_tokens: int = 0) -> PredictorScore:
    """Replay ``chunks`` through ``predictor`` (``observe(layer, experts)``, ``predict(layer,
    budget)``); rows of the first ``skip_tokens`` tokens train it without being scored."""
    budget = budget or header.k
    n = header.n_layers
    score = PredictorScore()
    pending: tuple[int, set[int]] | None = None
    first = None
    for t, layer, experts in trace_rows(chunks):
        first = t if first is None else first
        if pending is not None and pending[0] == layer and t - first >= skip_tokens:
            got = sum(1 for e in experts if e in pending[1])
            score.rows += 1
            score.requested += len(experts)
            score.predicted += len(pending[1])
            score.hits += got
            score.per_layer_hits[layer] = score.per_layer_hits.get(layer, 0) + got
            score.per_layer_requested[layer] = score.per_layer_requested.get(layer, 0) + len(experts)
        predictor.observe(layer, experts)
        nxt = (layer + 1) % n
        pending = (nxt, set(predictor.predict(nxt, budget)))
    return score
