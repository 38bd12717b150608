"""Storage reads for the mechanism: issue, notice completion, join, and the warm-start drip.

Reads go through :class:`expertfs.runtime.io.ExpertReader` straight into host slots (checksums
on first read). Completion is noticed without a thread of our own: each future's done-callback
appends it to a deque (the only thing that runs on an I/O worker), and the mechanism drains the
deque on its own thread at every call. So all residency state is touched by one thread.

The warm start loads many experts at prefetch priority; issued at once they would sit in front
of every later prefetch (same priority, first come first served). So warm reads are *dripped*:
at most ``depth`` in flight, the next one issued from the done-callback of the previous; none
while a demand read is in flight (a warm read at the drive shares its bandwidth with the read
the forward pass waits for), resuming from the done-callback of the last demand read; and none
while the owner holds the drip (``hold``/``go``: the engine holds it until the first logits, so
the trunk's reads and the prompt's own experts go first). The warm queue, the demand count and
the hold are the shared state, guarded by a lock; ``resolve`` takes a queued warm read out of
the drip and issues it at demand priority when the forward pass needs it first.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ..io import ExpertReader, Priority, ReadFuture
from .entry import Entry, State

__all__ = ["Loader"]


class Loader:
    def __init__(self, reader: ExpertReader, view: Callable[[int], Any], *, warm_depth: int) -> None:
        self.reader = reader
        self._view = view                           # host slot -> buffer
        self._done: deque[tuple[Entry, ReadFuture]] = deque()
        self._warm: deque[Entry] = deque()
        self._warm_set: set[int] = set()            # keys still queued for the drip
        self._warm_inflight = 0
        self._warm_depth = max(1, warm_depth)
        self._demand = 0                            # demand reads in flight: the drip waits
        self.held = False                           # hold(): the drip waits until go()
        self._lock = threading.RLock()
        self._pumping = False
        self.closed = False

    # -- issuing ---------------------------------------------------------------------------
    def issue(self, e: Entry, priority: Priority) -> ReadFuture:
        """Read ``e`` into its host slot; ``e`` is LOADING until the future is drained."""
        e.state = State.LOADING
        fut = self.reader.read_expert(e.layer, e.expert, into=self._view(e.host_slot),
                                      priority=priority)
        e.future = fut
        done = self._done
        fut.add_done_callback(lambda f, e=e: done.append((e, f)))
        if priority == Priority.DEMAND:
            with self._lock:
                self._demand += 1
            fut.add_done_callback(self._demand_done)
        return fut

    def queue_warm(self, entries: list[Entry]) -> None:
        with self._lock:
            for e in entries:
                e.state = State.LOADING
                e.warm = True
                self._warm.append(e)
                self._warm_set.add(e.key)
        self._pump()

    def _pump(self) -> None:
        with self._lock:
            self._pumping = True
            try:
                while (self._warm and self._warm_inflight < self._warm_depth and not self._demand
                       and not self.held and not self.closed):
                    e = self._warm.popleft()
                    if e.key not in self._warm_set:     # taken out by resolve/unqueue
                        continue
                    self._warm_set.discard(e.key)
                    self._warm_inflight += 1
                    fut = self.issue(e, Priority.PREFETCH)
                    fut.add_done_callback(self._warm_done)
            finally:
                self._pumping = False

    def hold(self) -> None:
        """Issue no more warm reads until :meth:`go` (those in flight finish), e.g. while the
        model's trunk loads from the same drive."""
        with self._lock:
            self.held = True

    def go(self) -> None:
        with self._lock:
            self.held = False
        self._pump()

    def _warm_done(self, _fut: ReadFuture) -> None:
        with self._lock:
            self._warm_inflight -= 1
            if self._pumping:          # called back at once inside _pump: its loop goes on
                return
        self._pump()

    def _demand_done(self, _fut: ReadFuture) -> None:
        with self._lock:
            self._demand -= 1
            if self._demand or self._pumping:
                return
        self._pump()

    # -- the mechanism's side ------------------------------------------------------------------
    def resolve(self, e: Entry) -> ReadFuture:
        """The future of a LOADING entry; a warm read still queued is issued now, at demand
        priority, and a queued prefetch is promoted."""
        if e.warm:
            with self._lock:
                if e.key in self._warm_set:
                    self._warm_set.discard(e.key)
                    return self.issue(e, Priority.DEMAND)
        fut = e.future
        if fut.priority != Priority.DEMAND and not fut.done():
            self.reader.handle.scheduler.promote(fut, Priority.DEMAND)
        return fut

    def unqueue(self, e: Entry) -> bool:
        """Drop a warm read that was never issued; False if it has been issued."""
        if not e.warm:
            return False
        with self._lock:
            if e.key in self._warm_set:
                self._warm_set.discard(e.key)
                return True
        return False

    def started(self, e: Entry) -> bool:
        """Whether ``e``'s read was issued (a queued warm read was not)."""
        if not e.warm:
            return e.future is not None
        with self._lock:
            return e.key not in self._warm_set

    def drain(self) -> list[tuple[Entry, ReadFuture]]:
        """Reads completed since the last drain (including cancelled ones)."""
        out = []
        done = self._done
        while done:
            out.append(done.popleft())
        return out

    @property
    def warm_pending(self) -> int:
        with self._lock:
            return len(self._warm_set) + self._warm_inflight

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._warm.clear()
            self._warm_set.clear()
