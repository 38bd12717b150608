"""The prefetcher: predictions from several sources in, bounded prefetch reads out, scored per source.

Sources are names: ``"gate"`` (the model's next-layer gate lookahead, through
``provider.prefetch``), ``"history"`` (``HistoryPredictor``), ``"mtp"`` (draft routes) or any other.
``submit(source, layer, experts)`` takes a ranked list for one layer and asks the target (the
cache mechanism) to start reads for them, best first, while the number of prefetch reads in
flight is under ``max_in_flight`` and the target has slots to spare; the target answers
"issued", "resident" (already cached or on its way) or "refused" (no room: stop).

Per source (``SourceStats``): its predictions scored when the layer actually runs
(``on_route``), as a ``PredictionScore`` (``score``):

* **coverage**: of the experts the layer used, the share this source predicted *and* that were
  resident in time (not still loading) — over the layers it made predictions for;
* **recall** and **precision** of its predictions, timing aside;

and its reads, from the cache's listener:

* **late**: used experts it fetched whose read was still in flight (``late_bytes``);
* **wasted**: experts it fetched that were evicted or cancelled unused (``wasted_bytes``: bytes
  actually read for nothing).

Pure bookkeeping over the target's answers; tested with a fake target and with the real cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .score import PredictionScore

__all__ = ["Prefetcher", "PrefetchTarget", "SourceStats"]


class PrefetchTarget(Protocol):
    def start_prefetch(self, layer: int, expert: int, source: str) -> str: ...
    def prefetch_in_flight(self) -> int: ...
    def expert_bytes(self, layer: int, expert: int) -> int: ...


@dataclass
class SourceStats:
    """One source's predictions (``score``: predicted, needed at the layers it predicted for,
    hits, covered) and its reads."""

    score: PredictionScore = field(default_factory=PredictionScore)
    submissions: int = 0       # submit() calls
    issued: int = 0            # reads started for its predictions
    issued_bytes: int = 0
    resident: int = 0          # predictions already resident or loading when submitted
    refused: int = 0           # predictions not issued (no room or in-flight bound)
    used: int = 0              # its reads later used
    late: int = 0
    late_bytes: int = 0
    wasted: int = 0            # its reads evicted or cancelled unused
    wasted_bytes: int = 0
    cancelled: int = 0

    def as_dict(self) -> dict[str, Any]:
        sc = self.score
        return {"submissions": self.submissions, "predicted": sc.predicted,
                "issued": self.issued, "issued_bytes": self.issued_bytes,
                "resident": self.resident, "refused": self.refused, "requested": sc.needed,
                "hits": sc.hits, "covered": sc.covered, "used": self.used, "late": self.late,
                "late_bytes": self.late_bytes, "wasted": self.wasted,
                "wasted_bytes": self.wasted_bytes, "cancelled": self.cancelled,
                **sc.ratios("coverage", "recall", "precision")}


class Prefetcher:
    def __init__(self, target: PrefetchTarget, *, max_in_flight: int = 16,
                 max_per_submit: int | None = None) -> None:
        self.target = target
        self.max_in_flight = max(0, max_in_flight)
        self.max_per_submit = max_per_submit
        self.sources: dict[str, SourceStats] = {}
        self._pending: dict[int, dict[str, set[int]]] = {}   # layer -> source -> predicted ids

    def stats(self, source: str) -> SourceStats:
        s = self.sources.get(source)
        if s is None:
            s = self.sources[source] = SourceStats()
        return s

    def submit(self, source: str, layer: int, experts: Sequence[int]) -> int:
        """Prefetch ``experts`` of ``layer`` (best first) for ``source``; returns reads issued."""
        st = self.stats(source)
        st.submissions += 1
        seen = self._pending.setdefault(layer, {}).setdefault(source, set())
        todo = []
        for e in experts:
            e = int(e)
            if e not in seen:
                seen.add(e)
                todo.append(e)
        st.score.predicted += len(todo)
        if self.max_per_submit is not None:
            st.refused += max(0, len(todo) - self.max_per_submit)
            todo = todo[:self.max_per_submit]
        issued = 0
        t = self.target
        room = self.max_in_flight - t.prefetch_in_flight() if todo else 0
        for i, e in enumerate(todo):
            if issued >= room:
                st.refused += len(todo) - i
                break
            r = t.start_prefetch(layer, e, source)
            if r == "issued":
                issued += 1
                st.issued += 1
                st.issued_bytes += t.expert_bytes(layer, e)
            elif r == "resident":
                st.resident += 1
            else:
                st.refused += len(todo) - i
                break
        return issued

    def active(self, layer: int) -> bool:
        return layer in self._pending

    def on_route(self, layer: int, experts: Sequence[int], in_time: Sequence[bool]) -> None:
        """Layer ``layer`` runs with ``experts``; ``in_time[i]``: experts[i] was resident (not
        loading, not absent) when asked for. Scores every source that predicted this layer."""
        preds = self._pending.pop(layer, None)
        if not preds:
            return
        ids = [int(e) for e in experts]
        for source, predicted in preds.items():
            self.stats(source).score.add_needed(predicted, ids, in_time)

    # -- the cache mechanism's listener ----------------------------------------------------------
    def on_used(self, source: str, nbytes: int) -> None:
        self.stats(source).used += 1

    def on_late(self, source: str, nbytes: int) -> None:
        st = self.stats(source)
        st.late += 1
        st.late_bytes += nbytes

    def on_wasted(self, source: str, nbytes: int, cancelled: bool) -> None:
        st = self.stats(source)
        st.wasted += 1
        st.wasted_bytes += nbytes
        st.cancelled += cancelled

    def report(self) -> dict[str, dict[str, Any]]:
        return {name: s.as_dict() for name, s in sorted(self.sources.items())}
