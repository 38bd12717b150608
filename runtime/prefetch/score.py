"""One scorecard for expert predictions: what a predictor named against what was then needed.

Every predictor and report counts the same four things, per layer visit (one layer run, the
union over its tokens, or one trace row):

* ``predicted``: experts the predictor named;
* ``needed``: experts the layer then used;
* ``hits``: needed experts it had named;
* ``covered``: of those hits, the ones resident in time (not still loading). Where timing is
  not scored (offline, or a predictor that does not see the cache) every hit counts as covered.

and derives the same ratios from them:

* ``recall`` = hits / needed (timing aside);
* ``coverage`` = covered / needed (the share of needed experts predicted and resident in time;
  equal to ``recall`` where timing is not scored);
* ``precision`` = hits / predicted;
* ``waste`` = (predicted - hits) / predicted (the share of predictions nobody asked for);
* ``predicted_per_needed`` = predicted / needed.

A ratio with a zero denominator is 0.0. Reports that also count reads (bytes issued, late,
evicted unused) hold a ``PredictionScore`` next to their own counters.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["PredictionScore"]


@dataclass
class PredictionScore:
    predicted: int = 0           # experts named
    needed: int = 0              # experts the scored layers used
    hits: int = 0                # needed and named
    covered: int = 0             # hits resident in time (all hits where timing is not scored)

    def add(self, predicted: Collection[int], needed: Iterable[int],
            in_time: Iterable[bool] | None = None) -> int:
        """One layer visit: ``predicted`` named, ``needed`` used. Returns the hits."""
        self.predicted += len(predicted)
        return self.add_needed(predicted, needed, in_time)

    def add_needed(self, predicted: Collection[int], needed: Iterable[int],
                   in_time: Iterable[bool] | None = None) -> int:
        """Score a visit whose predictions were already counted in ``predicted``: every element
        of ``needed`` counts once; ``in_time[i]``: needed[i] was resident in time (``None``:
        timing not scored, every hit is covered). Returns the hits."""
        needed = list(needed)
        self.needed += len(needed)
        if in_time is None:
            h = sum(1 for e in needed if e in predicted)
            c = h
        else:
            h = c = 0
            for e, ok in zip(needed, in_time):
                if e in predicted:
                    h += 1
                    c += bool(ok)
        self.hits += h
        self.covered += c
        return h

    @property
    def recall(self) -> float:
        return self.hits / self.needed if self.needed else 0.0

    @property
    def coverage(self) -> float:
        return self.covered / self.needed if self.needed else 0.0

    @property
    def precision(self) -> float:
        return self.hits / self.predicted if self.predicted else 0.0

    @property
    def waste(self) -> float:
        return (self.predicted - self.hits) / self.predicted if self.predicted else 0.0

    @property
    def predicted_per_needed(self) -> float:
        return self.predicted / self.needed if self.needed else 0.0

    def copy(self) -> PredictionScore:
        return PredictionScore(**self._counts())

    def __add__(self, other: PredictionScore) -> PredictionScore:
        return PredictionScore(**{k: v + getattr(other, k) for k, v in self._counts().items()})

    def __sub__(self, other: PredictionScore) -> PredictionScore:
        """The counts since ``other`` (an earlier copy of this score)."""
        return PredictionScore(**{k: v - getattr(other, k) for k, v in self._counts().items()})

    def _counts(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def ratios(self, *names: str, digits: int | None = None) -> dict[str, float]:
        """The named ratios (properties above), rounded to ``digits`` if given."""
        out: dict[str, Any] = {n: getattr(self, n) for n in names}
        if digits is not None:
            out = {n: round(v, digits) for n, v in out.items()}
        return out
