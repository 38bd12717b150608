"""Emulating a low-RAM box honestly: a memory cgroup that caps the whole process, page cache
included, plus cold caches and the block device's readahead setting.

Used by the low-RAM benchmarks (``bench_lowram.py``); needs root. Method from
../shared/reference/machine-facts.md: create the cgroup under this process's own memory cgroup,
start the measured program through a shell that joins it and ``exec``s, read the peak and the
fault counters afterwards, remove the cgroup.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

__all__ = ["MemCgroup", "drop_caches", "readahead", "disk_read_bytes", "block_device_of", "Run",
           "TIMED_OUT", "run_capped", "disk_bandwidth"]


def _memory_root() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            parts = line.strip().split(":", 2)
            if len(parts) == 3 and "memory" in parts[1].split(","):
                return "/sys/fs/cgroup/memory" + parts[2]
    raise RuntimeError("no cgroup v1 memory controller for this process")


class MemCgroup:
    """A child memory cgroup with a hard limit (bytes), removed on exit."""

    def __init__(self, limit: int) -> None:
        self.path = os.path.join(_memory_root(), f"expertfs-bench-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        self._write("memory.limit_in_bytes", str(limit))
        self.limit = limit

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def stat(self) -> dict[str, int]:
        return {k: int(v) for k, v in (line.split() for line in self.read("memory.stat").splitlines())}

    def wrap(self, argv: list[str]) -> list[str]:
        """A command line that joins this cgroup, then execs ``argv``."""
        procs = os.path.join(self.path, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *argv]

    def close(self) -> None:
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)

    def __enter__(self) -> "MemCgroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def block_device_of(path: str) -> str:
    """``vda`` for a file on /dev/vda (partitions resolved to their disk)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    link = os.path.realpath(f"/sys/dev/block/{major}:{minor}")
    name = os.path.basename(link)
    parent = os.path.basename(os.path.dirname(link))
    return parent if os.path.exists(f"/sys/block/{parent}") else name


def disk_read_bytes(dev: str) -> int:
    with open(f"/sys/block/{dev}/stat") as f:
        return int(f.read().split()[2]) * 512


@contextlib.contextmanager
def readahead(dev: str, kb: int | None) -> Iterator[int]:
    """Set ``/sys/block/DEV/queue/read_ahead_kb`` for the duration, restoring it afterwards."""
    path = f"/sys/block/{dev}/queue/read_ahead_kb"
    with open(path) as f:
        old = int(f.read())
    if kb is not None:
        with open(path, "w") as f:
            f.write(str(kb))
    try:
        yield old if kb is None else kb
    finally:
        with open(path, "w") as f:
            f.write(str(old))


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_bytes: int
    failcnt: int
    major_faults: int
    disk_read: int


def page_in(paths: tuple[str, ...]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


#: ``Run.returncode`` of a run killed at its timeout (``timeout(1)``'s)
TIMED_OUT = 124


def run_capped(argv: list[str], limit: int | None, dev: str, timeout: float = 1800,
               env: dict[str, str] | None = None, warm: tuple[str, ...] = ()) -> Run:
    """Run ``argv`` cold (caches dropped) under a memory cap (None: no cap); ``warm``: with
    these files read back into the page cache after the drop (a resident mmap peer). A run
    past ``timeout`` seconds is killed and returned with ``TIMED_OUT``."""
    drop_caches()
    page_in(warm)
    cg = MemCgroup(limit) if limit else None
    try:
        cmd = cg.wrap(argv) if cg else argv
        before = disk_read_bytes(dev)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as e:      # a run that never finishes is a result too
            err = e.stderr or b""
            text = err.decode(errors="replace") if isinstance(err, bytes) else err
            p = subprocess.CompletedProcess(cmd, TIMED_OUT, "",
                                            f"{text}\ntimed out after {timeout:g} s")
        dt = time.perf_counter() - t0
        read = disk_read_bytes(dev) - before
        peak = int(cg.read("memory.max_usage_in_bytes")) if cg else 0
        fail = int(cg.read("memory.failcnt")) if cg else 0
        faults = cg.stat().get("total_pgmajfault", 0) if cg else 0
        return Run(p.returncode, p.stdout, p.stderr, dt, peak, fail, faults, read)
    finally:
        if cg:
            cg.close()


def disk_bandwidth(store: str) -> float:
    """Random whole-expert read bandwidth (bytes/s) of ``store``'s drive: the best backend at
    QD 8, cold (``expertfs bench io``), the disk roofline's numerator."""
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "expertfs"), "bench", "io",
                          store, "--qd", "8", "--backend", "direct,buffered", "--cold", "--json",
                          "--no-auto"], capture_output=True, text=True, check=True).stdout
    return max(float(p["gbps"]) for p in json.loads(out)["points"]) * 1e9
