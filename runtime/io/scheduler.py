"""A bounded, prioritised read queue served by a fixed pool of worker threads.

``workers`` is the queue depth: at most that many reads run at once. Waiting reads sit in a
heap ordered by (priority, submission order), so a demand read overtakes every queued
prefetch. A queued read can be cancelled (its future's ``cancel()``), promoted to a higher
priority, or displaced: when ``max_pending`` reads already wait, a new read pushes out the
oldest of the least urgent ones if they are less urgent than it, and otherwise waits for room
(or raises :class:`QueueFullError` with ``block=False``). Running reads are never interrupted.

``max_bytes`` (None: no bound) bounds the bytes of the reads running at once, besides their
count: the most urgent waiting read starts only while the running reads of its priority or a
more urgent one, with it, stay within the bound, or when none of those runs (so a read larger
than the bound runs alone). Reads that share a drive share its bandwidth: eight 9 MB reads
started together all land near the end of the eighth's time, where one after another the first
lands after an eighth of it and its consumer can start on it then. A single large read is
already many requests to the device (the block layer splits it), so a few megabytes in flight
keep a drive busy while the reads land in the order they were asked for.

``background_workers`` threads (none by default) serve the ``BACKGROUND`` reads, and only
them, at the lowest CPU priority (nice 19); the other workers then never take one. Such a read
costs CPU besides the drive's time (the system call, the checksum run after it, and the
kernel's first touch of each fresh page it lands in: on a virtual machine whose host has not
backed that memory yet, seconds a GB, bench/README.md), and on a box whose cores all compute
the forward pass that CPU is taken from it; at nice 19 it is taken from idle time instead.
A promoted background read is served by the other workers like any read of its new priority.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any

from .errors import IOUsageError, QueueFullError

__all__ = ["Priority", "ReadFuture", "ReadScheduler"]

log = logging.getLogger(__name__)


class Priority(IntEnum):
    """Lower is more urgent."""

    DEMAND = 0
    PREFETCH = 1
    BACKGROUND = 2      # nobody waits for it (the warm start): the background workers' only


class ReadFuture(Future):
    """A ``concurrent.futures.Future`` with the read's priority, tag and timestamps
    (``time.perf_counter_ns`` at submit, start and completion; 0 until reached)."""

    def __init__(self, priority: Priority, tag: Any = None,
                 scheduler: ReadScheduler | None = None) -> None:
        super().__init__()
        self.priority = priority
        self.tag = tag
        self.t_submit = time.perf_counter_ns()
        self.t_start = 0
        self.t_done = 0
        self._entry: list[Any] | None = None
        self._scheduler = scheduler

    def cancel(self) -> bool:
        """Cancel a read that has not started; False once it runs or ran."""
        if not super().cancel():
            return False
        if self._scheduler is not None:
            self._scheduler._cancelled(self)
        return True

    @property
    def latency_ns(self) -> int:
        """Submit to completion; 0 while not done."""
        return self.t_done - self.t_submit if self.t_done else 0


class ReadScheduler:
    def __init__(self, workers: int, *, max_pending: int | None = None, name: str = "io",
                 max_bytes: int | None = None, background_workers: int = 0) -> None:
        if workers < 1:
            raise IOUsageError(f"queue depth {workers} is below 1", fix="use a queue depth of 1 or more")
        if background_workers < 0:
            raise IOUsageError(f"{background_workers} background workers", fix="use 0 or more")
        if max_pending is not None and max_pending < 1:
            raise IOUsageError(f"max_pending {max_pending} is below 1", fix="use None or 1 or more")
        self.workers = workers
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        self._running_bytes = [0] * len(Priority)      # bytes of the running reads, per priority
        self._heap: list[list[Any]] = []     # [priority, seq, future, fn]; fn None once removed
        self._live = 0                       # entries whose fn is not None
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)        # workers wait here for reads
        self._bg_cv = threading.Condition(self._lock)     # background workers wait here
        self.background_workers = background_workers
        self._space = threading.Condition(self._lock)     # submitters wait here for room
        self._closed = False
        self.running = 0
        self.max_running = 0
        self.stats = {"submitted": 0, "completed": 0, "failed": 0, "cancelled": 0, "displaced": 0,
                      "promoted": 0}
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        self._threads += [threading.Thread(target=self._work, args=(True,), daemon=True,
                                           name=f"{name}-bg{i}") for i in range(background_workers)]
        for t in self._threads:
            t.start()

    # -- submitting ------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], *, priority: Priority = Priority.DEMAND,
               tag: Any = None, block: bool = True, nbytes: int = 0) -> ReadFuture:
        """Queue ``fn`` (a read of ``nbytes``, which ``max_bytes`` counts) and return its future."""
        fut = ReadFuture(priority if type(priority) is Priority else Priority(priority), tag, self)
        with self._cv:
            while True:
                if self._closed:
                    raise IOUsageError("the read queue is closed", fix="submit before close()")
                if self.max_pending is None or self._live < self.max_pending:
                    break
                if self._displace_for(fut.priority):
                    continue
                if not block:
                    raise QueueFullError(f"{self._live} reads already wait, none less urgent",
                                         fix="wait for reads to complete or raise max_pending")
                self._space.wait()
            entry = [int(fut.priority), next(self._seq), fut, fn, max(0, int(nbytes))]
            fut._entry = entry
            heapq.heappush(self._heap, entry)
            self._live += 1
            self.stats["submitted"] += 1
            self._wake(entry[0])
        return fut

    def _wake_background(self) -> None:
        """Wake a background worker when a background read has become the most urgent waiting
        one: its workers sleep while urgent reads are ahead of it, and nothing else wakes them
        when the last of those is taken or removed."""
        head = self._head()
        if self.background_workers and head is not None and head[0] == Priority.BACKGROUND:
            self._bg_cv.notify()

    def _head(self) -> list[Any] | None:
        """The most urgent waiting read (the cancelled ones ahead of it dropped), or None."""
        while self._heap and self._heap[0][3] is None:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def _wake(self, priority: int) -> None:
        """Wake a worker of the lane that serves a read of ``priority``."""
        if priority == Priority.BACKGROUND and self.background_workers:
            self._bg_cv.notify()
        else:
            self._cv.notify()

    def _displace_for(self, priority: int) -> bool:
        """Cancel the oldest of the least urgent waiting reads if less urgent than ``priority``."""
        live = [e for e in self._heap if e[3] is not None]
        if not live:
            return False
        worst = max(live, key=lambda e: (e[0], -e[1]))
        if worst[0] <= priority:
            return False
        self._remove(worst)
        self.stats["displaced"] += 1
        log.debug("displaced a queued priority-%d read for a priority-%d one", worst[0], priority)
        worst[2].cancel()
        return True

    def _remove(self, entry: list[Any]) -> None:
        if entry[3] is not None:
            entry[3] = None
            self._live -= 1
            self._space.notify()
            self._wake_background()

    def _cancelled(self, fut: ReadFuture) -> None:
        with self._lock:
            self.stats["cancelled"] += 1
            if fut._entry is not None:
                self._remove(fut._entry)
                fut._entry = None

    def promote(self, fut: ReadFuture, priority: Priority) -> bool:
        """Move a still-queued read up to ``priority``; False if it already started or finished."""
        with self._cv:
            entry = fut._entry
            if entry is None or entry[3] is None or priority >= entry[0]:
                return False
            fn = entry[3]
            entry[3] = None
            new = [int(priority), entry[1], fut, fn, entry[4]]
            fut._entry = new
            fut.priority = Priority(priority)
            heapq.heappush(self._heap, new)
            self.stats["promoted"] += 1
            self._wake(int(priority))
            return True

    def cancel_pending(self, predicate: Callable[[ReadFuture], bool] | None = None, *,
                       min_priority: Priority = Priority.PREFETCH) -> int:
        """Cancel queued (not started) reads at ``min_priority`` or less urgent for which
        ``predicate(future)`` holds; returns how many were cancelled."""
        with self._cv:
            victims = [e[2] for e in self._heap
                       if e[3] is not None and e[0] >= min_priority and (predicate is None or predicate(e[2]))]
        return sum(1 for f in victims if f.cancel())

    @property
    def pending(self) -> int:
        return self._live

    # -- serving ---------------------------------------------------------------------------
    def _fits(self, entry: list[Any]) -> bool:
        """``entry`` may start under ``max_bytes`` (see the module docstring)."""
        if self.max_bytes is None:
            return True
        ahead = sum(self._running_bytes[:entry[0] + 1])
        return ahead == 0 or ahead + entry[4] <= self.max_bytes

    def _mine(self, entry: list[Any], background: bool) -> bool:
        """Whether a worker of this lane serves ``entry``: background workers only the
        background reads, the others every read but those when there are background workers."""
        bg = entry[0] == Priority.BACKGROUND
        return bg if background else not (bg and self.background_workers)

    def _work(self, background: bool = False) -> None:
        if background:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)   # this thread
            except (OSError, AttributeError):
                pass
        cv = self._bg_cv if background else self._cv
        while True:
            with self._cv:
                while True:
                    head = self._head()
                    if self._closed and not any(e[3] is not None and self._mine(e, background)
                                                for e in self._heap):
                        return
                    if head is not None and self._mine(head, background) and self._fits(head):
                        break
                    cv.wait()
                entry = heapq.heappop(self._heap)
                if not background:
                    self._wake_background()        # this may have been the last urgent read
                fut, fn, prio, nbytes = entry[2], entry[3], entry[0], entry[4]
                entry[3] = None
                entry[2] = fut._entry = None          # no reference cycle left to the collector
                self._live -= 1
                if self.max_pending is not None:
                    self._space.notify()
                if not fut.set_running_or_notify_cancel():
                    continue
                self.running += 1
                self.max_running = max(self.max_running, self.running)
                self._running_bytes[prio] += nbytes
            fut.t_start = time.perf_counter_ns()
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the future's owner
                fut.t_done = time.perf_counter_ns()
                self._done(prio, nbytes, "failed")
                fut.set_exception(e)
            else:
                fut.t_done = time.perf_counter_ns()
                self._done(prio, nbytes, "completed")
                fut.set_result(result)

    def _done(self, prio: int, nbytes: int, outcome: str) -> None:
        with self._cv:
            self.running -= 1
            self.stats[outcome] += 1
            self._running_bytes[prio] -= nbytes
            if self.max_bytes is not None and nbytes:
                self._cv.notify_all()                   # a waiting read may fit now
                self._bg_cv.notify_all()

    def close(self, *, cancel_pending: bool = True, wait: bool = True) -> None:
        """Stop accepting reads; cancel (or drain) the queued ones; join the workers."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            victims = [e[2] for e in self._heap if e[3] is not None] if cancel_pending else []
            self._cv.notify_all()
            self._bg_cv.notify_all()
            self._space.notify_all()
        for f in victims:
            f.cancel()
        if wait:
            for t in self._threads:
                t.join()
