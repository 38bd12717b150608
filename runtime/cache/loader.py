"""Storage reads for the mechanism: issue, notice completion, join, and the background drip.

Reads go through :class:`expertfs.runtime.io.ExpertReader` straight into host slots (checksums
on first read). Completion is noticed without a thread of our own: each future's done-callback
appends it to a deque (the only thing that runs on an I/O worker), and the mechanism drains the
deque on its own thread at every call. So all residency state is touched by one thread.

Reads nobody waits for yet, the predictions' (``queue_prefetch``, at PREFETCH priority) and the
warm start's (``queue_warm``, at BACKGROUND: the I/O engine's nice-19 worker, so their CPU, fresh
tier pages first touched included, comes from idle time, not the forward pass's), are
*dripped*: at most ``depth`` in flight, the next one issued from the done-callback of the
previous, predictions first; none while a demand read is in flight (a
background read at the drive shares its bandwidth with the read the forward pass waits for, and
a read cannot be stopped once issued), resuming from the done-callback of the last demand read;
and no warm read while the owner holds the drip (``hold``/``go``: the engine holds it until the
first logits, so the trunk's reads and the prompt's own experts go first). So background reads
use the drive while the forward pass computes, and a wrong prediction costs the demand read
after it at most the rest of one read. The queues, the demand count and the hold are the shared
state, guarded by a lock; ``resolve`` takes a queued read out of the drip and issues it at
demand priority when the forward pass needs it first, ``unqueue`` drops one never issued.
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
    def __init__(self, reader: ExpertReader, view: Callable[[int], Any], *, depth: int) -> None:
        self.reader = reader
        self._view = view                           # host slot -> buffer
        self._done: deque[tuple[Entry, ReadFuture]] = deque()
        self._warm: deque[Entry] = deque()
        self._spec: deque[Entry] = deque()          # predictions: before the warm start's
        # key -> the entry queued for the drip under it; by identity, as a key dropped from the
        # drip and queued again by a new entry leaves the old entry behind in its deque
        self._queued: dict[int, Entry] = {}
        self._drip_inflight = 0
        self._depth = max(1, depth)
        self._demand = 0                            # demand reads in flight: the drip waits
        self.held = False                           # hold(): warm reads wait until go()
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
        self._queue(entries, self._warm)

    def queue_prefetch(self, e: Entry) -> None:
        """Read ``e`` (a prediction) when the drive is free of demand reads; ahead of warm reads."""
        self._queue([e], self._spec)

    def _queue(self, entries: list[Entry], q: deque[Entry]) -> None:
        with self._lock:
            for e in entries:
                e.state = State.LOADING
                e.dripped = True
                q.append(e)
                self._queued[e.key] = e
        self._pump()

    def _next(self) -> tuple[Entry, Priority] | None:
        """The next dripped read and its priority: predictions first (PREFETCH), then the warm
        start's (BACKGROUND: the I/O engine's low-priority worker, its CPU taken from idle)."""
        for q, prio in ((self._spec, Priority.PREFETCH), (self._warm, Priority.BACKGROUND)):
            if q is self._warm and self.held:
                break
            while q:
                e = q.popleft()
                if self._queued.get(e.key) is e:    # else taken out by resolve/unqueue
                    del self._queued[e.key]
                    return e, prio
        return None

    def _pump(self) -> None:
        with self._lock:
            self._pumping = True
            try:
                while self._drip_inflight < self._depth and not self._demand and not self.closed:
                    nxt = self._next()
                    if nxt is None:
                        break
                    self._drip_inflight += 1
                    fut = self.issue(*nxt)
                    fut.add_done_callback(self._drip_done)
            finally:
                self._pumping = False

    def hold(self) -> None:
        """Issue no more warm reads until :meth:`go` (those in flight finish), e.g. while the
        model's trunk loads from the same drive (predictions still go)."""
        with self._lock:
            self.held = True

    def go(self) -> None:
        with self._lock:
            self.held = False
        self._pump()

    def _drip_done(self, _fut: ReadFuture) -> None:
        with self._lock:
            self._drip_inflight -= 1
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
        """The future of a LOADING entry; a read still queued for the drip is issued now, at
        demand priority, and a queued prefetch is promoted."""
        if e.dripped:
            with self._lock:
                if self._queued.get(e.key) is e:
                    del self._queued[e.key]
                    return self.issue(e, Priority.DEMAND)
        fut = e.future
        if fut.priority != Priority.DEMAND and not fut.done():
            self.reader.handle.scheduler.promote(fut, Priority.DEMAND)
        return fut

    def unqueue(self, e: Entry) -> bool:
        """Drop a dripped read that was never issued; False if it has been issued."""
        if not e.dripped:
            return False
        with self._lock:
            if self._queued.get(e.key) is e:
                del self._queued[e.key]
                return True
        return False

    def started(self, e: Entry) -> bool:
        """Whether ``e``'s read was issued (one queued for the drip, or dropped from it, was not)."""
        if not e.dripped:
            return e.future is not None
        with self._lock:
            return self._queued.get(e.key) is not e and e.future is not None

    def drain(self) -> list[tuple[Entry, ReadFuture]]:
        """Reads completed since the last drain (including cancelled ones)."""
        out = []
        done = self._done
        while done:
            out.append(done.popleft())
        return out

    @property
    def drip_pending(self) -> int:
        """Dripped reads queued or in flight."""
        with self._lock:
            return len(self._queued) + self._drip_inflight

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._warm.clear()
            self._spec.clear()
            self._queued.clear()
