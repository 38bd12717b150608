"""A fault-injecting backend for tests: wraps any backend and makes chosen reads fail.

Each :class:`Fault` hits reads that cover ``offset`` (any read when ``None``), ``times`` times
(``-1``: every time): ``"eio"`` raises ``OSError(errno)``, ``"short"`` reads only ``keep``
bytes (half when ``None``), ``"delay"`` sleeps ``delay_s`` first, ``"corrupt"`` flips one byte
of what was read. ``hits`` counts what fired, per kind. :class:`FaultyRun` is a decode through
the tiered provider reading through it (the decode fault tests and ``tools/fault_run.py``).
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from expertfs.runtime.io.errors import IOUsageError
from expertfs.runtime.io.protocol import Availability, IOBackend, RawFile

__all__ = ["Fault", "FaultInjectingBackend", "FaultyRun"]

_KINDS = ("eio", "short", "delay", "corrupt")


@dataclass
class Fault:
    kind: str
    times: int = 1
    offset: int | None = None
    delay_s: float = 0.0
    keep: int | None = None
    errno: int = errno_mod.EIO

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise IOUsageError(f"fault kind {self.kind!r} is not one of {', '.join(_KINDS)}",
                               fix="pick a known fault kind")

    def matches(self, file_offset: int, n: int) -> bool:
        return self.times != 0 and (self.offset is None or file_offset <= self.offset < file_offset + n)


class _FaultyFile(RawFile):
    def __init__(self, inner: RawFile, owner: FaultInjectingBackend) -> None:
        super().__init__(inner.path, inner.size)
        self.inner = inner
        self.owner = owner
        self.host_only = inner.host_only

    def prepare(self, buf: Any) -> Any:
        return self.inner.prepare(buf)

    def _take(self, file_offset: int, n: int) -> list[Fault]:
        fired = []
        with self.owner.lock:
            for f in self.owner.faults:
                if f.matches(file_offset, n):
                    if f.times > 0:
                        f.times -= 1
                    self.owner.hits[f.kind] += 1
                    fired.append(f)
        return fired

    def pread_into(self, dest: Any, start: int, end: int, file_offset: int) -> int:
        fired = self._take(file_offset, end - start)
        for f in fired:
            if f.kind == "delay":
                time.sleep(f.delay_s)
        for f in fired:
            if f.kind == "eio":
                raise OSError(f.errno, os.strerror(f.errno), self.path)
        short = next((f for f in fired if f.kind == "short"), None)
        if short is not None:
            keep = short.keep if short.keep is not None else (end - start) // 2
            end = start + max(0, min(keep, end - start))
            if end == start:
                return 0
        n = self.inner.pread_into(dest, start, end, file_offset)
        bad = next((f for f in fired if f.kind == "corrupt"), None)
        if n > 0 and bad is not None:
            at = start + (0 if bad.offset is None else min(n - 1, max(0, bad.offset - file_offset)))
            dest[at] = int(dest[at]) ^ 0xFF
        return n

    def close(self) -> None:
        self.inner.close()


class FaultInjectingBackend(IOBackend):
    name = "faults"

    def __init__(self, inner: IOBackend, faults: Iterable[Fault] = ()) -> None:
        self.inner = inner
        self.faults = list(faults)
        self.hits: Counter[str] = Counter()
        self.lock = threading.Lock()

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "test backend")

    def add(self, fault: Fault) -> None:
        with self.lock:
            self.faults.append(fault)

    def describe(self) -> str:
        return f"faults over {self.inner.describe()}"

    def open_raw(self, path: str | os.PathLike[str]) -> RawFile:
        return _FaultyFile(self.inner.open_raw(path), self)


class FaultyRun:
    """A greedy decode on the store at ``path`` through the tiered provider, every expert read
    through a :class:`FaultInjectingBackend` (``faults``), with fast retries and a RAM tier of
    ``slots`` experts (small, so decode steps read experts again)."""

    def __init__(self, path: Any, *, verify: str = "first", slots: int = 10,
                 prompt: tuple[int, ...] = (1, 2, 3, 4, 5), n: int = 6) -> None:
        from expertfs.runtime.cache.provider import TieredProvider
        from expertfs.runtime.engine import Engine, EngineOptions
        from expertfs.runtime.io import RetryPolicy, get_backend
        from expertfs.store.reader import Store
        self.prompt, self.n = list(prompt), n
        self.store = Store.open(str(path))
        self.faults = FaultInjectingBackend(get_backend("buffered"))
        prov = TieredProvider(self.store, ram_bytes=slots * self.store.extent(1, 0).length,
                              backend=self.faults, warm_start=False, record_usage=False,
                              verify=verify)
        self.reader = prov.reader
        self.reader.handle.retry = RetryPolicy(attempts=3, backoff_s=0.0001, max_backoff_s=0.001)
        self.eng = Engine(self.store, prov, EngineOptions(fused="off"))

    def tokens(self, before_decode: Any = None) -> list[int]:
        """Prefill, call ``before_decode(self)`` (inject a fault, damage the store), decode."""
        self.eng.reset()
        logits = self.eng.prefill(self.prompt)
        if before_decode is not None:
            before_decode(self)
        out: list[int] = []
        for _ in range(self.n):
            out.append(int(logits.argmax()))
            logits = self.eng.decode(out[-1])
        return out

    def clear(self) -> None:
        with self.faults.lock:
            self.faults.faults.clear()

    def close(self) -> None:
        self.eng.close()
        self.store.close()
