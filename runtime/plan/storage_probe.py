"""``expertfs plan``'s storage measurements: random whole-extent reads of the store (or
expert-sized ranges of a GGUF) per available backend at queue depths k and 2k, the file's pages
dropped before each point (``posix_fadvise``; the system page cache is never dropped by a
plan), shaped like ``expertfs bench io --json`` and read by the same function as
``--io-profile``; and the short check a later plan runs beside the cached figure.
"""

from __future__ import annotations

import os
import random
from typing import Any

from .rates import Range, storage_from_profile

__all__ = ["probe_storage", "storage_check"]


def _target(path: str, slot_bytes: int, store_path: str | None):
    """What the probes read: the store's extents, or expert-sized ranges of a plain file."""
    from ...store.reader import Store
    from ..io.bench import target_from_file, target_from_store
    if store_path is not None:
        with Store.open(store_path) as s:
            return target_from_store(s)
    read = min(slot_bytes, os.path.getsize(path) // 4096 * 4096)
    return target_from_file(path, max(4096, read - read % 4096))


def _cold_point(target, backend: str, qd: int, order: list[int], **kw: Any):
    """One ``io.bench.run_point`` of ``order``'s reads, the file's pages dropped first."""
    from ..io.bench import run_point
    from ..io.pagecache import drop_file_cache
    drop_file_cache(target.path)
    return run_point(target, backend, qd, order, verify=False, **kw)


def probe_storage(path: str, k: int, slot_bytes: int, *, store_path: str | None = None,
                  total_bytes: int = 96 << 20, seed: int = 0) -> tuple[Range, dict[str, Any]]:
    """Measure whole-extent random reads on ``path``: (GB/s range, details)."""
    from ..io.backends import backend_status

    target = _target(path, slot_bytes, store_path)
    status = backend_status()
    backends = [b for b in ("kvikio", "direct", "buffered") if status[b].available]
    qds = sorted({max(1, k), min(32, 2 * max(1, k))})
    n = max(1, min(len(target.reads), max(total_bytes, 4 * max(qds) * target.mean_size)
                   // max(1, target.mean_size), 4096))
    order = random.Random(seed).sample(range(len(target.reads)), min(n, len(target.reads)))
    points = []
    for qd in qds:
        for b in backends:
            try:
                p = _cold_point(target, b, qd, order)
            except Exception as e:                       # a backend failing here is not fatal
                points.append({"backend": b, "qd": qd, "gbps": 0.0, "error": str(e)})
                continue
            points.append({"backend": b, "qd": qd, "gbps": p.gbps, "lat_us": p.lat_us,
                           "reads": p.reads, "bytes": p.bytes,
                           "cpu_us_per_read": p.cpu_us_per_read})
    profile = {"points": points, "read_size": target.mean_size,
               "cold": "file pages dropped (posix_fadvise DONTNEED) before each point"}
    try:                                  # the backend ``run`` opens this file with (cached)
        from ..io.auto import choose_backend
        profile["auto"] = {"backend": choose_backend(target.path).backend}
    except Exception:                     # no choice: the fastest at the demand-read depth
        pass
    rng, detail = storage_from_profile(profile, k, label=f"measured now on {target.path} "
                                       f"({len(order)} random reads per point)")
    detail["points"] = points
    try:        # the CPU of reads into fresh memory, as the warm start fills the RAM tier
        pts = [_fresh_cpu(target, detail, order) for _ in range(FRESH_POINTS)]
        detail["cpu_s_per_gb"], detail["cpu_s_per_gb_slow"] = min(pts), max(pts)
        detail["cpu_fresh"] = True
    except Exception as e:                               # keep the figure of the plain point
        detail["cpu_fresh_error"] = str(e)
    return rng, detail


#: fresh-memory points, the cheapest the fast end's and the dearest the slow end's: on a virtual
#: machine the first touch of guest memory the host has not backed yet cost 2.6 CPU s/GB where
#: memory freed and taken again cost 0.05 (THP, bench/README.md), and a run in a new process
#: meets either (bench/README.md "The prompt window"). The second point's slab reuses what the
#: first freed.
FRESH_POINTS = 2


def _fresh_cpu(target, detail: dict[str, Any], order: list[int]) -> float:
    p = _cold_point(target, detail["backend"], detail["slow_qd"], order, fresh=True)
    return (p.cpu_user_s + p.cpu_sys_s) / (p.bytes / 1e9)


def storage_check(path: str, slot_bytes: int, backend: str, qd: int, *,
                  store_path: str | None = None, total_bytes: int = 48 << 20) -> float:
    """GB/s of one short point of whole-extent random reads on ``path`` (``backend`` at ``qd``,
    a fresh random sample, file pages dropped first): the drive's speed now, beside the figure
    ``probe_storage`` cached (``plan.boxcache.storage_spread``)."""
    target = _target(path, slot_bytes, store_path)
    n = max(qd, min(len(target.reads), total_bytes // max(1, target.mean_size)))
    order = random.Random().sample(range(len(target.reads)), min(n, len(target.reads)))
    return _cold_point(target, backend, qd, order).gbps
