"""``auto``: measure the candidate backends on the actual file and open it with the fastest.

The probe reads the same random, read-sized, non-overlapping ranges with each candidate at
one queue depth, the file's pages dropped before each (``posix_fadvise``), in two alternating
rounds, and keeps each candidate's best. Some drives are faster buffered than direct, so
nothing is assumed. Within 15% of the fastest, direct wins over buffered: direct I/O keeps the
page cache out of the RAM budget, and on a disk whose runs vary by tens of percent a smaller
margin would flip the choice from one probe to the next. kvikio gets no such preference: it is
chosen only when it measured faster than every other candidate for the destination in use
(``destination="host"``: the expert cache reads into host slots, and the probe reads into host
buffers too), since where it does not read into device memory it is a POSIX path like the
others with a CUDA dependency on top. A candidate that fails to open or read (kvikio's cuFile
on a misconfigured GDS box) is skipped with its reason. ``mmap`` is never a candidate (it is a
baseline). The choice is logged with its reason and cached per file (device, inode, size,
mtime) in ``$EXPERTFS_CACHE_DIR`` or ``~/.cache/expertfs/io-probe.json``. Under a memory
cap the runtime takes direct over buffered wherever both could read (``capped_choice``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .backends import BACKENDS, backend_status, get_backend
from .buffers import PAGE, aligned_empty
from .errors import BackendUnavailable, IOEngineError, IOUsageError
from .pagecache import drop_file_cache
from .protocol import DEFAULT_QUEUE_DEPTH, FileHandle, IOBackend
from .retry import RetryPolicy

__all__ = ["AutoChoice", "PREFERENCE", "probe_backends", "choose_backend", "capped_choice",
           "open_file", "default_cache_dir"]

log = logging.getLogger(__name__)

PREFERENCE = ("kvikio", "direct", "buffered")
MIN_PROBE_FILE = 1 << 20
TIE = 0.15


@dataclass(frozen=True)
class AutoChoice:
    backend: str
    reason: str
    gbps: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    read_size: int = 0
    cached: bool = False
    destination: str = "host"     # what the probe read into: the reads' destination in use


def default_cache_dir() -> Path:
    env = os.environ.get("EXPERTFS_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "expertfs"


def _probe_one(backend: IOBackend, path: str, offsets: Sequence[int], read_size: int,
               queue_depth: int) -> float:
    drop_file_cache(path)
    with backend.open(path, queue_depth=queue_depth) as fh:
        bufs = [aligned_empty(read_size) for _ in range(min(queue_depth, len(offsets)))]
        t0 = time.perf_counter()
        futs = [fh.pread(bufs[i % len(bufs)], off, read_size) for i, off in enumerate(offsets[:len(bufs)])]
        nxt = len(bufs)
        total = 0
        while futs:
            f = futs.pop(0)
            total += f.result()
            if nxt < len(offsets):
                futs.append(fh.pread(bufs[nxt % len(bufs)], offsets[nxt], read_size))
                nxt += 1
        dt = time.perf_counter() - t0
    return total / dt / 1e9


def probe_backends(path: str | os.PathLike[str], *, candidates: Sequence[str] | None = None,
                   read_size: int | None = None, probe_bytes: int = 64 << 20,
                   queue_depth: int = DEFAULT_QUEUE_DEPTH, rounds: int = 2,
                   seed: int = 0) -> tuple[dict[str, float], dict[str, str], int]:
    """Measure candidates on ``path``: (GB/s per backend, skipped backend -> reason, read size)."""
    path = os.fspath(path)
    size = os.stat(path).st_size
    read_size = read_size or min(4 << 20, max(PAGE, size // 8 // PAGE * PAGE))
    if read_size > size:
        raise IOUsageError(f"probe reads of {read_size} bytes do not fit in {size} bytes",
                           path=path, fix="probe with a smaller read size")
    slots = size // read_size
    rng = random.Random(seed)
    offsets = [s * read_size for s in rng.sample(range(slots), min(slots, max(1, probe_bytes // read_size)))]
    status = backend_status()
    names = list(candidates) if candidates is not None else [n for n in PREFERENCE]
    gbps: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for n in names:
        if n not in BACKENDS:
            raise IOUsageError(f"backend {n!r} is not known", fix=f"pick from {', '.join(BACKENDS)}")
        if not status[n].available:
            skipped[n] = status[n].reason
    live = [n for n in names if n not in skipped]
    for r in range(rounds):
        for n in (live if r % 2 == 0 else live[::-1]):
            if n in skipped:
                continue
            try:
                g = _probe_one(get_backend(n), path, offsets, read_size, queue_depth)
            except (IOEngineError, OSError) as e:
                skipped[n] = getattr(e, "reason", None) or str(e)
                gbps.pop(n, None)
                continue
            gbps[n] = max(gbps.get(n, 0.0), g)
    return gbps, skipped, read_size


def _pick(gbps: dict[str, float]) -> str:
    """kvikio if it measured faster than every other candidate; else, within ``TIE`` of the
    fastest, the earlier of direct > buffered."""
    posix = {n: g for n, g in gbps.items() if n != "kvikio"}
    if "kvikio" in gbps and (not posix or gbps["kvikio"] > max(posix.values())):
        return "kvikio"
    best = max(posix.values())
    for n in PREFERENCE:
        if n in posix and posix[n] >= best * (1 - TIE):
            return n
    return max(posix, key=posix.__getitem__)


def _cache_key(path: str, read_size: int | None, names: Sequence[str], qd: int) -> str:
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{read_size or 0}:{qd}:{','.join(names)}"


def _load_cache(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(file: Path, data: dict[str, Any]) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".io-probe.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except OSError as e:
        log.debug("cannot cache the backend probe in %s: %s", file, e)


def choose_backend(path: str | os.PathLike[str], *, candidates: Sequence[str] | None = None,
                   read_size: int | None = None, probe_bytes: int = 64 << 20,
                   queue_depth: int = DEFAULT_QUEUE_DEPTH, cache_dir: str | os.PathLike[str] | None = None,
                   refresh: bool = False, destination: str = "host") -> AutoChoice:
    """Pick the backend for ``path`` (cached), log the choice and why. ``destination``: where
    the reads go; only ``"host"`` is probed (every reader in the runtime reads into host
    memory, whence the cache uploads)."""
    if destination != "host":
        raise IOUsageError(f"reads into {destination!r} memory are not probed",
                           fix="choose a backend by name for device destinations")
    path = os.fspath(path)
    names = list(candidates) if candidates is not None else list(PREFERENCE)
    size = os.stat(path).st_size
    if size < MIN_PROBE_FILE:
        status = backend_status()
        skipped = {n: status[n].reason for n in names if not status[n].available}
        choice = AutoChoice("buffered", f"the file ({size} bytes) is too small to measure "
                            f"(< {MIN_PROBE_FILE} bytes); buffered reads of it stay cached",
                            skipped=skipped)
        log.info("auto backend for %s: %s (%s)", path, choice.backend, choice.reason)
        return choice
    cache_file = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_file = cache_file / "io-probe.json"
    key = _cache_key(path, read_size, names, queue_depth) + ":" + destination
    cache = _load_cache(cache_file)
    if not refresh and key in cache:
        rec = cache[key]
        if rec.get("backend") in BACKENDS and backend_status()[rec["backend"]].available:
            choice = AutoChoice(**{**rec, "cached": True})
            log.info("auto backend for %s: %s (cached probe: %s)", path, choice.backend, choice.reason)
            return choice
    gbps, skipped, rs = probe_backends(path, candidates=names, read_size=read_size,
                                       probe_bytes=probe_bytes, queue_depth=queue_depth)
    for n, why in skipped.items():
        log.info("auto: %s not used for %s: %s", n, path, why)
    if not gbps:
        raise BackendUnavailable("auto", "no candidate backend could read the file: " +
                                 "; ".join(f"{n}: {w}" for n, w in skipped.items()), path=path,
                                 fix="check the file system and the candidates")
    best = _pick(gbps)
    fastest = max(gbps, key=gbps.__getitem__)
    measured = ", ".join(f"{n} {g:.2f} GB/s" for n, g in sorted(gbps.items(), key=lambda kv: -kv[1]))
    reason = (f"{measured} on cold random {rs}-byte reads into {destination} memory at "
              f"QD{queue_depth}"
              + ("" if best == fastest else
                 f"; {best} is within {TIE:.0%} of {fastest} and is preferred (no page-cache use)")
              + ("; skipped: " + "; ".join(f"{n} ({w})" for n, w in skipped.items()) if skipped else ""))
    choice = AutoChoice(best, reason, gbps, skipped, rs, destination=destination)
    opts = _options(choice)
    if opts:
        choice = replace(choice, reason=reason + "; kvikio reads " + (
            "with O_DIRECT" if opts["direct_io"] else "through the page cache")
            + ", the faster POSIX mode here")
    log.info("auto backend for %s: %s (%s)", path, best, choice.reason)
    rec = asdict(choice)
    rec.pop("cached")
    cache[key] = rec
    _save_cache(cache_file, cache)
    return choice


def capped_choice(choice: AutoChoice) -> AutoChoice:
    """``choice`` for reads under a memory cap: ``direct`` instead of ``buffered`` where the
    probe read with both. Uncapped, buffered may measure faster (the drive's own caching, the
    kernel's larger requests), but under a cgroup cap every buffered read allocates page-cache
    pages charged to the process and reclaimed again at once: on a DeepSeek-V3 cut at a third
    of its size whose probe measured buffered faster, direct decoded faster (bench/README.md)."""
    if choice.backend != "buffered" or "direct" not in choice.gbps:
        return choice
    return replace(choice, backend="direct",
                   reason=choice.reason + "; direct under a memory cap (no page-cache pages to "
                   "charge and reclaim)")


def _options(choice: AutoChoice) -> dict[str, Any]:
    """kvikio's POSIX path reads in the mode the probe measured faster: O_DIRECT as ``direct``
    unless ``buffered`` beat it by more than the tie margin (the same rule as between backends)."""
    g = choice.gbps
    if choice.backend != "kvikio" or "direct" not in g or "buffered" not in g:
        return {}
    return {"direct_io": _pick({"direct": g["direct"], "buffered": g["buffered"]}) == "direct"}


def open_file(path: str | os.PathLike[str], *, backend: str | IOBackend = "auto",
              queue_depth: int = DEFAULT_QUEUE_DEPTH, max_pending: int | None = None,
              retry: RetryPolicy | None = None, read_size: int | None = None,
              cache_dir: str | os.PathLike[str] | None = None,
              drop_behind: bool = False) -> FileHandle:
    """Open ``path`` for reads with a backend object, a backend name, or ``"auto"``.
    The handle's ``choice`` is the :class:`AutoChoice` (``None`` unless auto).
    ``drop_behind`` (reads under a memory cap, which charges the page cache): auto takes
    ``direct`` where the probe could read with it, even where ``buffered`` measured faster
    (``capped_choice``); a ``buffered`` backend, by name or where direct cannot run, drops each
    read's pages from the page cache once copied."""
    choice = None
    if isinstance(backend, str):
        opts: dict[str, Any] = {}
        if backend == "auto":
            choice = choose_backend(path, read_size=read_size, queue_depth=queue_depth,
                                    cache_dir=cache_dir)
            if drop_behind:
                choice = capped_choice(choice)
            backend, opts = choice.backend, _options(choice)
        if backend == "buffered":
            opts["drop_behind"] = drop_behind
        backend = get_backend(backend, **opts)
    fh = backend.open(path, queue_depth=queue_depth, max_pending=max_pending, retry=retry)
    fh.choice = choice
    return fh
