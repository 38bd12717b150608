"""``expertfs bench io`` as data: random whole-expert reads per backend and queue depth.

Each point (backend, queue depth) reads the same seeded random sample of extents (or of
``read_size`` ranges of a plain file) with exactly ``qd`` reads in flight, cold (page cache
dropped before each point when permitted, the file's pages dropped otherwise; O_DIRECT is cold
regardless). A large sequential read of the same file, in the same run, is the ceiling each
point is compared with. After each point the last read of every buffer is checked: extents
against their xxh3 checksums, plain ranges against a plain ``pread``. Printing is the CLI's.
"""

from __future__ import annotations

import os
import platform
import queue
import random
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

from expertfs.errors import IntegrityError
from expertfs.store.layout import Extent

from .auto import AutoChoice, choose_backend
from .backends import BACKENDS, backend_status, get_backend
from .buffers import PAGE, aligned_empty, host_view
from .errors import BackendUnavailable, IOUsageError
from .pagecache import make_cold

__all__ = ["BenchTarget", "PointResult", "SeqResult", "BenchReport", "target_from_store",
           "target_from_file", "run_point", "run_sequential", "run_bench", "format_report",
           "format_bytes"]


@dataclass(frozen=True)
class BenchTarget:
    """What to read: ``reads`` are (offset, size) pairs; ``extents`` is set for a store."""

    path: str
    file_size: int
    reads: list[tuple[int, int]]
    extents: list[Extent] | None = None
    label: str = ""

    @property
    def mean_size(self) -> int:
        return int(sum(s for _, s in self.reads) / len(self.reads)) if self.reads else 0


def target_from_store(store: Any, *, read_size: int | None = None) -> BenchTarget:
    """Whole extents of a store (``read_size=None``) or ``read_size`` ranges of its experts.bin."""
    if read_size is not None:
        return target_from_file(store.experts_path, read_size, alignment=store.alignment)
    extents = list(store.extents())
    if not extents:
        raise IOUsageError("the store has no expert extents", path=store.path,
                           fix="benchmark a store made from an MoE model")
    size = os.stat(store.experts_path).st_size
    return BenchTarget(store.experts_path, size, [(e.offset, e.length) for e in extents], extents,
                       f"{len(extents)} expert extents")


def target_from_file(path: str | os.PathLike[str], read_size: int, *,
                     alignment: int = PAGE) -> BenchTarget:
    """Non-overlapping ``read_size`` ranges at multiples of ``read_size`` of a plain file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise IOUsageError("no such file (or not a regular file)", path=path,
                           fix="pass a store folder or a file to read")
    size = os.stat(path).st_size
    if read_size <= 0 or read_size % alignment:
        raise IOUsageError(f"read size {read_size} is not a positive multiple of {alignment}",
                           path=path, fix=f"use a size such as 4 MiB (a multiple of {alignment})")
    if read_size > size:
        raise IOUsageError(f"read size {format_bytes(read_size)} exceeds the file "
                           f"({format_bytes(size)})", path=path, fix="use a smaller --size")
    reads = [(i * read_size, read_size) for i in range(size // read_size)]
    return BenchTarget(path, size, reads, None, f"{len(reads)} ranges of {format_bytes(read_size)}")


@dataclass
class PointResult:
    backend: str
    qd: int
    reads: int
    bytes: int
    seconds: float
    gbps: float
    iops: float
    lat_us: dict[str, float]
    cpu_user_s: float
    cpu_sys_s: float
    cpu_us_per_read: float
    verified: int
    ratio_to_seq: float | None = None


@dataclass
class SeqResult:
    backend: str
    block: int
    qd: int
    bytes: int
    seconds: float
    gbps: float


@dataclass
class BenchReport:
    path: str
    file_size: int
    label: str
    read_size: int
    cold: str
    seq: SeqResult | None
    points: list[PointResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    auto: AutoChoice | None = None
    host: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def best(self) -> PointResult | None:
        return max(self.points, key=lambda p: p.gbps, default=None)


def host_info(path: str) -> dict[str, Any]:
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    info: dict[str, Any] = {"kernel": platform.release(), "cpus": os.cpu_count(),
                            "python": platform.python_version(), "device": dev}
    sysdir = f"/sys/dev/block/{dev}"
    for key, rel in (("rotational", "queue/rotational"), ("read_ahead_kb", "queue/read_ahead_kb"),
                     ("logical_block", "queue/logical_block_size")):
        for base in (sysdir, os.path.join(sysdir, "..")):
            try:
                with open(os.path.join(base, rel)) as f:
                    info[key] = f.read().strip()
                break
            except OSError:
                continue
    return info


def _check_bytes(target: BenchTarget, buf: Any, read: int) -> None:
    off, size = target.reads[read]
    view = host_view(buf)[:size]
    if target.extents is not None:
        e = target.extents[read]
        for p in e.parts:
            got = xxhash.xxh3_64_intdigest(view[p.rel_offset:p.rel_offset + p.nbytes])
            if got != p.checksum:
                raise IntegrityError(f"bench read of expert (layer {e.layer}, expert {e.expert}) "
                                     f"part {getattr(p.role, 'name', p.role)} does not match its "
                                     "checksum", path=target.path,
                                     fix="run `expertfs verify` on the store")
        return
    fd = os.open(target.path, os.O_RDONLY)
    try:
        ref = os.pread(fd, size, off)
    finally:
        os.close(fd)
    if ref != view.tobytes():
        raise IntegrityError(f"bench read of {size} bytes at offset {off} differs from a plain "
                             "pread of the same range", path=target.path,
                             fix="report this: the backend returned wrong bytes")


def run_point(target: BenchTarget, backend: str, qd: int, order: Sequence[int], *,
              verify: bool = True, fresh: bool = False) -> PointResult:
    """Read ``order`` (indices into target.reads) with ``qd`` reads in flight, into buffers on
    the pages the RAM tier's slab takes (``io.pages``: a read into 4 KiB pages is slower than
    into huge ones). ``fresh``: every read lands in memory never touched before (one slab, as
    the RAM tier's), so the CPU figures include the kernel's first touch of it (no
    verification then)."""
    be = get_backend(backend)
    biggest = max(target.reads[i][1] for i in order)
    done: queue.SimpleQueue = queue.SimpleQueue()
    lat: list[int] = []
    with be.open(target.path, queue_depth=qd) as fh:
        stride = -(-biggest // PAGE) * PAGE
        nbuf = min(qd, len(order))
        ring = aligned_empty(stride * nbuf, slab=True)
        bufs = [ring[i * stride:i * stride + biggest] for i in range(nbuf)]
        last = [-1] * len(bufs)
        slab = aligned_empty(stride * len(order), slab=True) if fresh else None
        verify = verify and not fresh

        def submit(k: int, slot: int) -> None:
            off, size = target.reads[order[k]]
            last[slot] = order[k]
            dst = bufs[slot] if slab is None else slab[k * stride:k * stride + size]
            f = fh.pread(dst, off, size, tag=slot)
            f.add_done_callback(done.put)

        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for k in range(len(bufs)):
            submit(k, k)
        nxt, total, left = len(bufs), 0, len(order)
        while left:
            f = done.get()
            total += f.result()
            lat.append(f.latency_ns)
            left -= 1
            if nxt < len(order):
                submit(nxt, f.tag)
                nxt += 1
        dt = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
    verified = 0
    if verify:
        for slot, r in enumerate(last):
            if r >= 0:
                _check_bytes(target, bufs[slot], r)
                verified += 1
    us = np.array(lat, dtype=np.float64) / 1e3
    user, sys_ = ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime
    n = len(order)
    return PointResult(backend, qd, n, total, dt, total / dt / 1e9, n / dt,
                       {"mean": float(us.mean()), "p50": float(np.percentile(us, 50)),
                        "p90": float(np.percentile(us, 90)), "p99": float(np.percentile(us, 99)),
                        "max": float(us.max())},
                       user, sys_, (user + sys_) / n * 1e6, verified)


def run_sequential(path: str, *, nbytes: int, block: int = 4 << 20, qd: int = 16,
                   backend: str | None = None) -> SeqResult:
    """Read the first ``nbytes`` of ``path`` in order, ``block`` at a time, ``qd`` in flight."""
    size = os.stat(path).st_size
    block = min(block, max(PAGE, size // PAGE * PAGE))
    n = max(1, min(nbytes, size) // block)
    if backend is None:
        backend = "direct" if backend_status()["direct"].available else "buffered"
    t = BenchTarget(path, size, [(i * block, block) for i in range(n)])
    p = run_point(t, backend, qd, list(range(n)), verify=False)
    return SeqResult(backend, block, qd, p.bytes, p.seconds, p.gbps)


def run_bench(target: BenchTarget, *, backends: Sequence[str], qds: Sequence[int],
              total_bytes: int = 256 << 20, cold: bool = True, seq_bytes: int = 512 << 20,
              verify: bool = True, seed: int = 0, with_auto: bool = True,
              on_point: Callable[[PointResult], None] | None = None) -> BenchReport:
    """Sequential ceiling, then every (backend, qd) point on the same random sample."""
    for b in backends:
        if b not in BACKENDS:
            raise IOUsageError(f"backend {b!r} is not known (expected: all, {', '.join(BACKENDS)})",
                               fix="pick backends from the list")
    if any(q < 1 for q in qds):
        raise IOUsageError(f"queue depths {list(qds)} must be >= 1", fix="e.g. --qd 1,4,16,32")
    status = backend_status()
    skipped = {b: status[b].reason for b in backends if not status[b].available}
    live = [b for b in backends if b not in skipped]
    n = max(1, min(len(target.reads), total_bytes // max(1, target.mean_size)))
    order = random.Random(seed).sample(range(len(target.reads)), n)
    read_size = target.mean_size
    method = make_cold(target.path, system=cold) if cold else "warm (page cache kept)"
    seq = run_sequential(target.path, nbytes=seq_bytes)
    report = BenchReport(target.path, target.file_size, target.label, read_size, method, seq,
                         skipped=skipped, host=host_info(target.path))
    for qd in qds:
        for b in live:
            if cold:
                make_cold(target.path)
            try:
                p = run_point(target, b, qd, order, verify=verify)
            except BackendUnavailable as e:
                report.skipped[b] = e.reason
                continue
            p.ratio_to_seq = p.gbps / seq.gbps if seq.gbps else None
            report.points.append(p)
            if on_point is not None:
                on_point(p)
        live = [b for b in live if b not in report.skipped]
    if with_auto:
        if cold:
            make_cold(target.path)
        report.auto = choose_backend(target.path, read_size=read_size - read_size % PAGE or PAGE,
                                     refresh=True)
    return report


def format_bytes(n: float) -> str:
    """4194304 -> '4.0MiB' (binary units, as fio prints them)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def _mib(b: float, s: float) -> str:
    return f"BW={b / s / 2**20:.0f}MiB/s ({b / s / 1e6:.0f}MB/s)({format_bytes(b)}/{s:.2f}s)"


def format_point(p: PointResult) -> list[str]:
    l = p.lat_us
    ratio = f", {p.ratio_to_seq:.2f}x seq" if p.ratio_to_seq is not None else ""
    return [f"{p.backend}: (qd={p.qd}) read: IOPS={p.iops:.0f}, {_mib(p.bytes, p.seconds)}{ratio}",
            f"    lat (usec): p50={l['p50']:.0f}, p90={l['p90']:.0f}, p99={l['p99']:.0f}, "
            f"avg={l['mean']:.0f}, max={l['max']:.0f}",
            f"    cpu: usr={p.cpu_user_s / p.seconds:.1%}, sys={p.cpu_sys_s / p.seconds:.1%}, "
            f"{p.cpu_us_per_read:.0f} us/read; verified {p.verified} buffers"]


def format_report(r: BenchReport) -> str:
    out = [f"{r.path}: {format_bytes(r.file_size)}, {r.label}, random reads of "
           f"~{format_bytes(r.read_size)}, {r.cold}",
           "host: " + ", ".join(f"{k}={v}" for k, v in r.host.items())]
    if r.seq is not None:
        s = r.seq
        out.append(f"seq-read (ceiling): ({s.backend}, bs={format_bytes(s.block)}, qd={s.qd}) "
                   f"{_mib(s.bytes, s.seconds)}")
    for p in r.points:
        out.extend(format_point(p))
    for b, why in r.skipped.items():
        out.append(f"{b}: skipped: {why}")
    best = r.best()
    if best is not None:
        out.append(f"best: {best.backend} qd={best.qd} {best.gbps:.2f} GB/s"
                   + (f" = {best.ratio_to_seq:.2f}x the sequential ceiling" if best.ratio_to_seq else ""))
    if r.auto is not None:
        out.append(f"auto picks: {r.auto.backend} ({r.auto.reason})")
    return "\n".join(out)
