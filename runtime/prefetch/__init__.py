"""Expert prefetch: predictors (pure) and the prefetcher that turns predictions into reads.

* ``history``: ``HistoryPredictor``, the next layer's experts from earlier routes (recency,
  cross-layer transitions, frequency, mixed by their online hit rates);
* ``prefetcher``: ``Prefetcher``, predictions from any number of named sources (gate lookahead,
  history, MTP drafts) issued under an in-flight bound and the cache's free slots, with
  coverage, waste and late bytes per source;
* ``evaluate``: a predictor's recall and precision on a routing trace, offline.
"""

from .evaluate import PredictorScore, evaluate_predictor, trace_rows
from .history import COMPONENTS, HistoryPredictor
from .prefetcher import Prefetcher, PrefetchTarget, SourceStats

__all__ = ["PredictorScore", "evaluate_predictor", "trace_rows", "COMPONENTS", "HistoryPredictor",
           "Prefetcher", "PrefetchTarget", "SourceStats"]
