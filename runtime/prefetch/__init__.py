"""Expert prefetch: predictors (pure) and the prefetcher that turns predictions into reads.

* ``history``: ``HistoryPredictor``, the next layer's experts from earlier routes (recency,
  cross-layer transitions, frequency, mixed by their online hit rates);
* ``prefetcher``: ``Prefetcher``, predictions from any number of named sources (gate lookahead,
  history, MTP drafts) issued under an in-flight bound and the cache's free slots, with
  coverage, waste and late bytes per source;
* ``lookahead``: the next-layer gate lookahead's scores;
* ``score``: ``PredictionScore``, the one scorecard (predicted, needed, hits, covered; recall,
  coverage, precision, waste) every predictor and report keeps.

A predictor's offline recall and precision on a trace is ``expertfs.runtime.eval.prefetch``.
"""

from .history import COMPONENTS, HistoryPredictor
from .prefetcher import Prefetcher, PrefetchTarget, SourceStats
from .score import PredictionScore

__all__ = ["COMPONENTS", "HistoryPredictor", "PredictionScore",
           "Prefetcher", "PrefetchTarget", "SourceStats"]
