"""The prefetcher: predictions from several sources in, bounded prefetch reads out, scored per source.

Sources are names: ``"gate"`` (the model's next-layer gate lookahead, through
``provider.prefetch``), ``"history"`` (``HistoryPredictor``), ``"mtp"`` (draft routes) or any other.
``submit(source, layer, experts)`` takes a ranked list for one layer and asks the target (the
cache mechanism) to start reads for them, best first, while the number of prefetch reads in
flight is under ``max_in_flight`` and the target has slots to spare; the target answers
"issued", "resident" (already cached or on its way) or "refused" (no room: stop).

Per source (``SourceStats``), counted when the layer actually runs (``on_route``):

* **coverage**: of the experts the layer used, the share this source predicted *and* that were
  resident in time (not still loading) — over the layers it made predictions for;
* **recall** and **precision** of its predictions, timing aside;
* **late**: used experts it fetched whose read was still in flight (``late_bytes``);
* **waste**: experts it fetched that were evicted or cancelled unused (``wasted_bytes``: bytes
  actually read for nothing).

Pure bookkeeping over the target's answers; tested with a fake target and with the real cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

__all__ = ["Prefetcher", "PrefetchTarget", "SourceStats"]


class PrefetchTarget(Protocol):
    def start_prefetch(self, layer: int, expert: int, source: str) -> str: ...
    def prefetch_in_flight(self) -> int: ...
    def expert_bytes(self, layer: int, expert: int) -> int: ...


@dataclass
class SourceStats:
    submissions: int = 0       # submit() calls
    predicted: int = 0         # distinct (layer, expert) predictions per layer visit
    issued: int = 0            # reads started for them
    issued_bytes: int = 0
    resident: int = 0          # predictions already resident or loading when submitted
    refused: int = 0           # predictions not issued (no room or in-flight bound)
    requested: int = 0         # experts used at layers this source predicted for
    hits: int = 0              # of those, predicted by this source
    covered: int = 0           # ... and resident in time
    used: int = 0              # its reads later used
    late: int = 0
    late_bytes: int = 0
    wasted: int = 0            # its reads evicted or cancelled unused
    wasted_bytes: int = 0
    cancelled: int = 0

    @property
    def coverage(self) -> float:
        return self.covered / self.requested if self.requested else 0.0

    @property
    def recall(self) -> float:
        return self.hits / self.requested if self.requested else 0.0

    @property
    def precision(self) -> float:
        return self.hits / self.predicted if self.predicted else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(coverage=self.coverage, recall=self.recall, precision=self.precision)
        return d


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
        st.predicted += len(todo)
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
        for source, predicted in preds.items():
            st = self.stats(source)
            st.requested += len(experts)
            for e, ok in zip(experts, in_time):
                if int(e) in predicted:
                    st.hits += 1
                    st.covered += bool(ok)

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
