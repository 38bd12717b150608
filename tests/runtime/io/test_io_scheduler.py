"""The read queue: at most queue-depth reads run, demand reads overtake queued prefetches,
queued reads can be cancelled, promoted or displaced, a full queue blocks or says so, and
the bytes of the reads in flight can be bounded."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from expertfs.runtime.io import (IOUsageError, Priority, QueueFullError, ReadScheduler,
                                 aligned_empty, get_backend)
from support.faults import Fault, FaultInjectingBackend


def _blocked(sched: ReadScheduler, n: int):
    """Occupy ``n`` workers until the returned event is set."""
    gate = threading.Event()
    started = threading.Semaphore(0)

    def hold():
        started.release()
        gate.wait(10)
        return "held"

    futs = [sched.submit(hold) for _ in range(n)]
    for _ in range(n):
        assert started.acquire(timeout=10)
    return gate, futs


def test_demand_overtakes_queued_prefetches():
    s = ReadScheduler(1)
    gate, _ = _blocked(s, 1)
    order = []
    pf = [s.submit(lambda i=i: order.append(f"p{i}"), priority=Priority.PREFETCH) for i in range(3)]
    d = s.submit(lambda: order.append("d"), priority=Priority.DEMAND)
    gate.set()
    d.result(10)
    for f in pf:
        f.result(10)
    assert order == ["d", "p0", "p1", "p2"]
    s.close()


def test_cancel_queued_and_cancel_pending_by_predicate():
    s = ReadScheduler(1)
    gate, _ = _blocked(s, 1)
    ran = []
    a = s.submit(lambda: ran.append("a"), priority=Priority.PREFETCH, tag=("L0", 1))
    b = s.submit(lambda: ran.append("b"), priority=Priority.PREFETCH, tag=("L0", 2))
    c = s.submit(lambda: ran.append("c"), priority=Priority.DEMAND, tag=("L0", 3))
    assert a.cancel()
    assert s.cancel_pending(lambda f: f.tag == ("L0", 2)) == 1
    assert s.cancel_pending() == 0              # demand reads are not prefetches
    gate.set()
    c.result(10)
    with pytest.raises(CancelledError):
        b.result(0)
    s.close()
    assert ran == ["c"] and s.stats["cancelled"] == 2 and s.pending == 0


def test_promote_moves_a_prefetch_ahead():
    s = ReadScheduler(1)
    gate, _ = _blocked(s, 1)
    order = []
    p1 = s.submit(lambda: order.append(1), priority=Priority.PREFETCH)
    p2 = s.submit(lambda: order.append(2), priority=Priority.PREFETCH)
    assert s.promote(p2, Priority.DEMAND)
    assert not s.promote(p2, Priority.DEMAND)       # already there
    gate.set()
    p1.result(10), p2.result(10)
    assert order == [2, 1] and p2.priority == Priority.DEMAND
    s.close()


def test_full_queue_displaces_oldest_prefetch_or_blocks():
    s = ReadScheduler(1, max_pending=2)
    gate, _ = _blocked(s, 1)
    p1 = s.submit(lambda: 1, priority=Priority.PREFETCH)
    p2 = s.submit(lambda: 2, priority=Priority.PREFETCH)
    d = s.submit(lambda: 3, priority=Priority.DEMAND)     # full: p1 (oldest prefetch) is dropped
    assert p1.cancelled() and not p2.cancelled() and s.stats["displaced"] == 1
    with pytest.raises(QueueFullError):
        s.submit(lambda: 4, priority=Priority.PREFETCH, block=False)
    d2 = []
    t = threading.Thread(target=lambda: d2.append(s.submit(lambda: 5, priority=Priority.DEMAND)))
    t.start()                                      # displaces p2, then runs
    t.join(10)
    assert p2.cancelled()
    d3 = []
    t = threading.Thread(target=lambda: d3.append(s.submit(lambda: 6)))
    t.start()                                      # two demand reads wait: it blocks
    t.join(0.2)
    assert t.is_alive()
    gate.set()
    t.join(10)
    assert d.result(10) == 3 and d2[0].result(10) == 5 and d3[0].result(10) == 6
    s.close()


def test_queue_depth_bounds_reads_in_flight(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    be = FaultInjectingBackend(get_backend("buffered"), [Fault("delay", times=-1, delay_s=0.01)])
    with be.open(path, queue_depth=3) as fh:
        bufs = [aligned_empty(4096) for _ in range(12)]
        futs = [fh.pread(b, (i % 4) * 4096, 4096) for i, b in enumerate(bufs)]
        assert all(f.result(10) == 4096 for f in futs)
        assert fh.scheduler.max_running == 3
        assert all(f.t_submit <= f.t_start <= f.t_done for f in futs)


def test_max_bytes_bounds_the_bytes_in_flight_and_keeps_their_order():
    """Reads of 6 units under a bound of 16 run two at a time, in the order submitted; a read
    larger than the bound runs alone; small reads run side by side up to the worker count; a
    running prefetch's bytes do not hold a demand read back."""
    s = ReadScheduler(8, max_bytes=16)
    lock = threading.Lock()
    live, peak, order = [0], [0], []

    def read(name, n, together=None):
        """A read of ``n`` units; ``together``: a barrier the reads meant to overlap meet at."""
        def fn():
            with lock:
                live[0] += n
                peak[0] = max(peak[0], live[0])
                order.append(name)
            if together is not None:
                together.wait(10)
            threading.Event().wait(0.01)
            with lock:
                live[0] -= n
        return fn

    pair = threading.Barrier(2)
    futs = [s.submit(read(f"m{i}", 6, pair), nbytes=6) for i in range(6)]
    for f in futs:
        f.result(10)
    assert peak[0] == 12 and order == [f"m{i}" for i in range(6)]
    peak[0] = 0
    futs = [s.submit(read("big", 40), nbytes=40), s.submit(read("m", 6), nbytes=6)]
    for f in futs:
        f.result(10)
    assert peak[0] == 40
    peak[0] = 0
    eight = threading.Barrier(8)
    futs = [s.submit(read(f"s{i}", 2, eight), nbytes=2) for i in range(8)]
    for f in futs:
        f.result(10)
    assert peak[0] == 16
    prefetch_runs = threading.Event()
    s.submit(lambda: prefetch_runs.wait(10), priority=Priority.PREFETCH, nbytes=16)
    assert s.submit(lambda: "demand", nbytes=16).result(10) == "demand"   # beside the prefetch
    prefetch_runs.set()
    s.close()


def test_errors_reach_the_future_and_close_cancels():
    s = ReadScheduler(1)
    f = s.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        f.result(10)
    gate, _ = _blocked(s, 1)
    q = s.submit(lambda: 1)
    gate.set()
    s.close()
    assert q.cancelled() or q.result() == 1
    with pytest.raises(IOUsageError, match="closed"):
        s.submit(lambda: 1)
    with pytest.raises(IOUsageError):
        ReadScheduler(0)


def _where() -> tuple[str, int]:
    """The running worker's thread name and nice value."""
    import os
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS,
                                                           threading.get_native_id())


def test_background_reads_take_their_own_low_priority_worker():
    """With a background worker, BACKGROUND reads run there at nice 19 and only there; the
    other reads never wait behind them (the background worker busy) and never run at nice 19;
    a queued background read promoted to DEMAND is served by the other workers."""
    s = ReadScheduler(2, name="t", background_workers=1)
    gate = threading.Event()
    bg = [s.submit(lambda: (gate.wait(10), _where())[1], priority=Priority.BACKGROUND)]
    bg += [s.submit(_where, priority=Priority.BACKGROUND) for _ in range(2)]
    urgent = [s.submit(_where, priority=p) for p in (Priority.DEMAND, Priority.PREFETCH)]
    for f in urgent:
        name, nice = f.result(10)                 # done while the background worker waits
        assert name.startswith("t-") and "bg" not in name and nice < 19
    late = bg[2]
    assert s.promote(late, Priority.DEMAND)       # still queued behind bg[0] and bg[1]
    name, nice = late.result(10)
    assert "bg" not in name and nice < 19
    gate.set()
    for f in bg[:2]:
        name, nice = f.result(10)
        assert name == "t-bg0" and nice == 19
    s.close()


def test_background_lane_wakes_when_urgent_reads_drain_and_closes_cleanly():
    """A background read never overtakes a queued urgent one, and starts as soon as those
    are taken (its worker woken then, not by a later submission); closing drains or cancels
    both lanes without hanging; with no background worker the others serve every priority."""
    s = ReadScheduler(1, name="w", background_workers=1)
    gate, held = _blocked(s, 1)
    d = s.submit(lambda: "d", priority=Priority.DEMAND)
    b = s.submit(lambda: "b", priority=Priority.BACKGROUND)
    with pytest.raises(TimeoutError):
        b.result(0.3)                             # behind the demand read still queued
    gate.set()
    assert b.result(10) == "b" and d.result(10) == "d" and held[0].result(10) == "held"
    gate2, _ = _blocked(s, 1)
    queued = [s.submit(lambda i=i: i, priority=p) for i, p in
              enumerate((Priority.DEMAND, Priority.BACKGROUND, Priority.PREFETCH))]
    gate2.set()
    s.close(cancel_pending=False)                 # drains both lanes, joins every worker
    assert [f.result(0) for f in queued] == [0, 1, 2]
    plain = ReadScheduler(1)
    assert plain.submit(_where, priority=Priority.BACKGROUND).result(10)[1] < 19
    plain.close()
    with pytest.raises(IOUsageError):
        ReadScheduler(1, background_workers=-1)
