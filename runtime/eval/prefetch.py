"""Score a predictor on a routing trace, offline and exactly: recall and precision per layer visit.

For each row of the trace (a token at a layer), in execution order, the predictor has already
seen every earlier row and was asked for that layer's experts right after the previous row (one
layer of lookahead, as the runtime asks it). Recall: the share of the route it predicted;
precision: the share of its predictions that the route used. No cache and no timing here: how
much of that turns into hits in time is measured on the real provider (``Prefetcher`` stats).
Both are ``PredictionScore``s, overall and per layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..prefetch.score import PredictionScore
from ..trace.file import TraceChunk, TraceHeader

__all__ = ["PredictorScore", "evaluate_predictor", "trace_rows"]


@dataclass
class PredictorScore:
    rows: int = 0                                                    # trace rows scored
    score: PredictionScore = field(default_factory=PredictionScore)  # all rows
    per_layer: dict[int, PredictionScore] = field(default_factory=dict)


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
            score.rows += 1
            score.score.add(pending[1], experts)
            score.per_layer.setdefault(layer, PredictionScore()).add(pending[1], experts)
        predictor.observe(layer, experts)
        nxt = (layer + 1) % n
        pending = (nxt, set(predictor.predict(nxt, budget)))
    return score
