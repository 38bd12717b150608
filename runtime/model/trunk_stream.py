"""Streaming the share of the quantized trunk a memory limit cannot hold, a layer ahead.

The trunk's matrices are pages of ``trunk.bin`` mapped from the page cache. Where the limit
leaves less room than the trunk (``run``'s fallback tier: a cap below the trunk and one layer's
experts), the kernel evicts trunk pages as the cap demands, least recently used first. A token
reads the trunk in the same order every time, the case LRU handles worst: each page faulted
back in pushes out one the same token reads again later, so a token re-reads several times
the bytes the cap keeps out, up to the whole trunk, each page faulted in while the compute
waits (bench/README.md).

``TrunkStream`` chooses which bytes go instead. After each forward (before the output head, from
the third on) it counts the bytes of the matrices it keeps that are not in memory (``mincore``):
under the LRU that is the deficit itself, measured rather than estimated. Once streaming that
deficit would have read clearly less than the trunk's re-reads of each of the last two forwards
(the process's reads from storage less the experts'; a small deficit costs the LRU less, and
after a prompt its re-reads can fall away within tokens), it streams the same share of every
unit's mapped matrices (a unit is a decoder layer's, or the output head's), the tail of each,
the share ``runtime.memory.trunk_stream_share`` sizes so the kept rest and two units' streamed
share fit; what goes missing later (a KV cache that grew) adds to it, and every so many tokens
the LRU is tried again (the deficit may have shrunk). A background thread reads unit L+1's share
in while unit L computes (from a layer's FFN, the head from the last layer's; ``MADV_WILLNEED``,
then ``MADV_POPULATE_READ`` to map it) and drops unit L-1's (``MADV_DONTNEED`` unmaps it,
``POSIX_FADV_DONTNEED`` frees its page-cache pages, which nothing else maps). A token then
re-reads about the deficit, ahead of the layer that needs it, and the kept bytes are not pushed
out. Advice never changes what a page holds: nothing writes the mapped trunk, so a dropped page
faults back in as it was.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import threading
from typing import Callable

import numpy as np

from ..memory import STREAM_MARGIN_MIN, trunk_stream_share
from .loader import TrunkWeights, mapped_matrices
from ..io.buffers import MADV_POPULATE_READ, libc
from .weights import TrunkReader

__all__ = ["STREAM_ENV", "STREAM_GAIN", "STREAM_RECHECK", "STREAM_VOTES", "TrunkStream", "jobs",
           "stream_trunk", "unit_spans"]

log = logging.getLogger(__name__)

#: Forwards in a row whose trunk re-reads exceed ``STREAM_GAIN`` times what streaming would read
#: before it starts (after a prompt the page cache's re-reads can fall away within a few tokens,
#: its activations freed: a margin keeps such a transient with the LRU) ...
STREAM_VOTES = 2
STREAM_GAIN = 1.25
#: ... and forwards measured while streaming before the LRU is tried again (the deficit may
#: have shrunk: a freed prompt, another process gone); the same rule then decides anew.
STREAM_RECHECK = 64
#: ``EXPERTFS_TRUNK_STREAM=0`` leaves a short trunk to the page cache (bench/trunk_stream_ab.py).
STREAM_ENV = "EXPERTFS_TRUNK_STREAM"

Span = tuple[int, int]              # [start, end) byte offsets in trunk.bin


def unit_spans(reader: TrunkReader, trunk: TrunkWeights) -> list[list[Span]]:
    """Per unit (each decoder block, then the output head), the byte spans in ``trunk.bin`` of
    the matrices it multiplies straight from the mapping, in file order (the row tables, read
    a row a token, and anything held dequantized are not among them)."""
    units = [[r for obj in (b.attn, b.dense, b.moe.shared if b.moe else None)
              for r in mapped_matrices(obj)] for b in trunk.blocks]
    units.append([trunk.output.q] if trunk.output.q is not None else [])
    return [sorted({s for r in raws if (s := reader.span_of(r.raw)) is not None})
            for raws in units]


def _tails(spans: list[Span], share: float, page: int) -> list[Span]:
    """The last ``share`` of each span, in whole pages inside it (a page a neighbour shares
    stays)."""
    out = []
    for a, b in spans:
        lo = -(-max(a, b - int((b - a) * share)) // page) * page
        hi = b // page * page
        if hi > lo:
            out.append((lo, hi))
    return out


def jobs(unit: int, head: int) -> tuple[list[int], list[int]]:
    """(units to drop, units to read) when unit ``unit`` is next to compute, of units
    ``0..head`` (``head``: the output head's, after the last layer's; the first layer's
    follows it): the unit before goes, the unit after comes in."""
    read = [unit + 1 if unit < head else 0]
    drop = [u for u in ([unit - 1] if unit else [head]) if u not in read and u != unit]
    return drop, read


class TrunkStream:
    """Streams a share of ``spans`` (per unit, the byte ranges of trunk.bin its mapped matrices
    take) of ``reader``'s mapping, sized from the kept bytes found missing after a forward, at
    least ``tolerance`` at a time (``deficit``: to start from; ``reads``: the bytes the process
    has read from storage for other things, the experts). The forward calls ``at(layer)`` as
    each layer's FFN starts and ``at(n_layers)`` before the output head."""

    def __init__(self, reader: TrunkReader, spans: list[list[Span]], deficit: int = 0,
                 tolerance: int = STREAM_MARGIN_MIN,
                 reads: Callable[[], int] = lambda: 0) -> None:
        self._spans, self.tolerance, self._reads = spans, tolerance, reads
        self._io: int | None = None             # the process's storage reads at the last
        self._other = 0                         # measure, and ``reads()`` then (the experts')
        self._votes = 0                         # forwards in a row streaming would read less
        self._seen = 0                          # forwards with logits seen
        self.measures = 0                       # forwards measured (past the first two)
        self._since = 0                         # ``measures`` when streaming started
        self._sizes = [sum(b - a for a, b in u) for u in spans]
        self._size = reader.mapped_bytes
        self._base = reader.base_address
        self._fd = os.open(reader.path, os.O_RDONLY)
        self._libc = libc()
        self.set_deficit(deficit)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="expertfs-trunk-stream",
                                        daemon=True)
        self._thread.start()

    def set_deficit(self, deficit: int) -> None:
        """Stream the share for ``deficit`` bytes: ``units`` (per unit, the page ranges read
        and dropped), ``bytes`` (re-read a token) and the kept pages' mask."""
        page = mmap.PAGESIZE
        self.deficit = deficit
        self.share = trunk_stream_share(self._sizes, deficit)
        self.units = [_tails(u, self.share, page) for u in self._spans]
        self.bytes = sum(b - a for u in self.units for a, b in u)
        kept = np.zeros(-(-self._size // page), dtype=bool)
        for a, b in (s for u in self._spans for s in u):
            kept[-(-a // page):b // page] = True
        for a, b in (s for u in self.units for s in u):
            kept[a // page:b // page] = False
        self._kept = kept

    def as_dict(self) -> dict[str, float]:
        return {"deficit_bytes": self.deficit, "share": self.share, "bytes": self.bytes}

    def missing(self) -> int:
        """Bytes of the kept pages not in memory now (``mincore``; 0 where it fails)."""
        vec = np.zeros(self._kept.size, dtype=np.uint8)
        if self._libc is None or self._libc.mincore(self._base, self._size,
                                                    vec.ctypes.data) != 0:
            return 0
        return int(np.count_nonzero(self._kept & (vec & 1 == 0))) * mmap.PAGESIZE

    def at(self, unit: int, measure: bool = False) -> None:
        """Unit ``unit`` is next to compute (a layer's FFN starts, or the head's product when
        ``unit`` is the number of layers): ``jobs`` for it, done in order by the thread, while
        it streams; ``measure`` (the head's turn in a forward that computes logits): count the
        kept bytes missing, from the third such forward on (past the prompt's evictions)."""
        if (self.share or measure) and 0 <= unit < len(self._spans) and self._fd >= 0:
            self._q.put((*jobs(unit, len(self._spans) - 1), measure))

    def _advise(self, spans: list[Span], advice: int) -> None:
        for a, b in spans if self._libc is not None else ():
            if self._libc.madvise(self._base + a, b - a, advice) != 0:
                log.debug("madvise(%d) on trunk.bin [%d, %d): %s", advice, a, b,
                          os.strerror(ctypes.get_errno()))

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            drop, read, measure = job
            for u in drop:
                self._advise(self.units[u], mmap.MADV_DONTNEED)
                for a, b in self.units[u]:
                    os.posix_fadvise(self._fd, a, b - a, os.POSIX_FADV_DONTNEED)
            if measure:
                self._measure()
            for u in read:
                self._advise(self.units[u], mmap.MADV_WILLNEED)
                self._advise(self.units[u], MADV_POPULATE_READ)

    def _measure(self) -> None:
        """After a forward: the trunk's re-reads since the last one (the process's reads from
        storage less the experts'), and from the third forward on (the first two's misses are
        the prompt's) the kept bytes out of memory, handed to ``_decide``."""
        io, other = _read_bytes(), self._reads()
        reread = None if io is None or self._io is None else io - self._io - (other - self._other)
        self._io, self._other = io, other
        self._seen += 1
        if self._seen <= 2:
            return
        gone = self.missing()
        log.debug("trunk: %d kept bytes out of memory, %s re-read by the last forward, "
                  "streaming %d a token", gone, reread, self.bytes)
        self._decide(gone, reread)
        self.measures += 1

    def _decide(self, gone: int, reread: int | None) -> None:
        """Kept bytes missing, ``tolerance`` or more, add to the deficit; the first time, only
        once streaming them would have read ``STREAM_GAIN`` times less than each of the last
        ``STREAM_VOTES`` forwards re-read of the trunk (a small deficit costs the LRU less, its
        pages going out and back in once). After ``STREAM_RECHECK`` forwards streaming, the LRU
        again."""
        if self.share and self.measures - self._since >= STREAM_RECHECK:
            self.set_deficit(0)                 # the LRU again, and the rule below anew
            self._votes = 0
            return
        if gone < max(1, self.tolerance):
            self._votes = 0
            return
        if not self.share:
            if reread is None:                  # no figure to weigh it against: the LRU
                return
            cost = trunk_stream_share(self._sizes, gone) * sum(self._sizes)
            self._votes = self._votes + 1 if cost * STREAM_GAIN < reread else 0
            if self._votes < STREAM_VOTES:
                return
            self._since = self.measures
        self.set_deficit(self.deficit + gone)
        log.info("trunk: %d MiB of the kept matrices out of memory: streaming %.0f%% of "
                 "them, %d MiB a token, a unit ahead", gone >> 20, self.share * 100,
                 self.bytes >> 20)

    def close(self) -> None:
        """Stop the thread after the jobs queued (the mapping outlives it)."""
        if self._fd < 0:
            return
        self._q.put(None)
        self._thread.join()
        os.close(self._fd)
        self._fd = -1


def stream_trunk(reader: TrunkReader, trunk: TrunkWeights, on: bool,
                 reads: Callable[[], int] = lambda: 0) -> TrunkStream | None:
    """A ``TrunkStream`` (starting from no deficit: the forwards measure it) for a run whose
    memory budget cannot hold the trunk (``on``; ``reads``: the experts' bytes read so far), or
    None where it is off (``STREAM_ENV``) or nothing is mapped to stream."""
    if not on or reader.base_address is None or os.environ.get(STREAM_ENV) == "0":
        return None
    spans = unit_spans(reader, trunk)
    return TrunkStream(reader, spans, reads=reads) if any(spans) else None


def _read_bytes() -> int | None:
    """Bytes this process has had read from storage (``/proc/self/io``; None where absent)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
