"""Short measurements for ``expertfs plan`` (about a second each): CPU dequant+matmul, memory
bandwidth and op dispatch, and on a CUDA machine the GPU's copy, memory and dequant+matmul
rates (storage: ``plan.storage_probe``). Each returns ``plan.rates.Range``/``DeviceRates``
with ``slow`` = the 30th percentile and ``fast`` = the best of the repetitions, and says where it came
from. The arithmetic that uses them is ``plan.predict``'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from .geometry import Matrix
from .rates import FLOAT_TYPES, DeviceRates, LinearCost, Range, stated_cpu

__all__ = ["probe_cpu", "probe_cuda", "linear_types", "host_memory",
           "cuda_memory"]

def _times(fn: Callable[[], Any], reps: int, budget_s: float, sync: Callable[[], None] | None = None
           ) -> list[float]:
    fn()                                          # warm-up (tables, allocator)
    if sync:
        sync()
    out: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(out) < reps and (not out or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append(time.perf_counter() - t0)
    return out


def _typical(times: list[float]) -> float:
    """The slow end's time: the 30th percentile. Runs on a shared machine have long tails (other
    processes); the median of a handful would mostly measure them."""
    xs = sorted(times)
    return xs[min(len(xs) - 1, int(0.3 * len(xs)))]


def _range(times: list[float], work: float, source: str) -> Range:
    """Work per second: slow = at the typical time, fast = at the best."""
    return Range(work / _typical(times), work / min(times), source)


# ------------------------------------------------------------------------------------------------
# CPU


def linear_types(mats: Sequence[Matrix], limit: int = 3) -> list[Matrix]:
    """The largest matrix of each ggml type among ``mats``, the types carrying the most bytes first."""
    share: dict[str, int] = {}
    big: dict[str, Matrix] = {}
    for m in mats:
        share[m.ggml_type] = share.get(m.ggml_type, 0) + m.nbytes * m.count
        if m.ggml_type not in big or m.elements > big[m.ggml_type].elements:
            big[m.ggml_type] = m
    return [big[t] for t in sorted(share, key=share.get, reverse=True)[:limit]]


def _weight_bytes(ggml_type: str, rows: int, cols: int, seed: int = 0):
    """Valid ggml bytes of a rows x cols matrix (a small pool of real blocks, tiled)."""
    import numpy as np
    import torch

    from ...formats.ggml import GGMLType, block_size, type_size
    from ...formats.random_blocks import make_blocks

    t = GGMLType[ggml_type]
    n_blocks = rows * cols // block_size(t)
    if ggml_type in FLOAT_TYPES:
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[ggml_type]
        w = (torch.randn(rows, cols) / cols ** 0.5).to(dt)
        return w.reshape(-1).view(torch.uint8).clone()
    pool = make_blocks(t, min(n_blocks, 64), cols ** -0.5, np.random.default_rng(seed))
    raw = np.resize(np.ascontiguousarray(pool).view(np.uint8).reshape(-1), n_blocks * type_size(t))
    return torch.from_numpy(raw)


def _fused_kernel(ggml_type: Any) -> Callable | None:
    """The runtime's compiled decode matvec for this type (``runtime.model.qmatvec``), if it is
    there and supports it; None otherwise (any import or API mismatch included)."""
    try:
        from .. import kernels as native
        from ..model import qmatvec
        if ggml_type in native.TYPES and native.available():
            return qmatvec.decode_matvec         # the native kernels take every type of theirs
        if qmatvec.available() and ggml_type in qmatvec.SUPPORTED:
            return qmatvec.fused_matvec
    except Exception:
        pass
    return None


def _linear_times(m: Matrix, device: str, budget_s: float, sync=None, fused: bool = False):
    """Time ``formats.dequant.linear`` (or, with ``fused``, the runtime's compiled matvec: then
    on ``m``'s own shape only, compiling once outside the timing) on a matrix like ``m``
    (capped in size) and on a small one: (big times, small times or None, big bytes, small
    bytes, shape, kernel name), or None when it cannot run."""
    import torch

    from ...formats.dequant import linear
    from ...formats.ggml import GGMLType, block_size, row_bytes

    try:
        t = GGMLType[m.ggml_type]
        bs = block_size(t)
    except (KeyError, ValueError):
        return None
    cols = m.cols
    kernel = _fused_kernel(t) if fused and device == "cpu" else None
    if kernel is not None:
        rows = max(1, min(m.rows, (16 << 20) // max(1, cols)))
        try:
            big = _weight_bytes(m.ggml_type, rows, cols)
            x = torch.randn(1, cols)
            if kernel(x, big, t, (rows, cols)) is not None:          # compiles (seconds, once)
                tb = _times(lambda: kernel(x, big, t, (rows, cols)), 7, budget_s, sync)
                return tb, None, rows * row_bytes(t, cols), 0, [rows, cols], "runtime.model.qmatvec"
        except Exception:
            pass                                                 # fall back to dequant.linear
    cap = (16 << 20) if m.ggml_type in FLOAT_TYPES else (4 << 20)    # float GEMV must leave the caches
    rows = max(1, min(m.rows, cap // max(1, cols)))
    small_cols = max(bs, 256 // bs * bs) if cols % bs == 0 else cols
    small_rows = 32
    try:
        big = _weight_bytes(m.ggml_type, rows, cols).to(device)
        small = _weight_bytes(m.ggml_type, small_rows, small_cols).to(device)
        x = torch.randn(1, cols, device=device)
        xs = torch.randn(1, small_cols, device=device)
        tb = _times(lambda: linear(x, big, t, (rows, cols)), 7, budget_s * 0.7, sync)
        ts = _times(lambda: linear(xs, small, t, (small_rows, small_cols)), 11, budget_s * 0.3, sync)
    except Exception:                                      # unsupported type or shape: no figure
        return None
    return (tb, ts, rows * row_bytes(t, cols), small_rows * row_bytes(t, small_cols), [rows, cols],
            "formats.dequant.linear")


def _fit(tb: float, ts: float | None, nb: int, ns: int) -> tuple[float, float]:
    """(overhead s, bytes/s) through two points: a call costs overhead + bytes / rate."""
    if ts is not None and tb > ts and nb > ns:
        rate = (nb - ns) / (tb - ts)
        return max(0.0, ts - ns / rate), rate
    return 0.0, nb / tb


def _linear_cost(m: Matrix, device: str, budget_s: float, sync=None,
                 threads: Sequence[int] = (), fused: bool = False) -> tuple[LinearCost, dict] | None:
    """Overhead and rate of dequant+matmul for ``m``'s type. On the CPU it is timed with one
    thread (the slow end: its typical run) and with each of ``threads`` (the fast end: the best
    of all), since a busy machine makes multi-threaded torch calls erratic."""
    import torch

    runs = []
    if device == "cpu":
        old = torch.get_num_threads()
        try:
            for n in dict.fromkeys([1, *threads]):
                torch.set_num_threads(n)
                got = _linear_times(m, device, budget_s / (1 + len(threads)), sync, fused)
                if got is None:
                    return None
                runs.append((n, got))
        finally:
            torch.set_num_threads(old)
    else:
        got = _linear_times(m, device, budget_s, sync)
        if got is None:
            return None
        runs.append((0, got))
    _, (tb, ts, nb, ns, shape, kname) = runs[0]

    def lo(xs: list[float] | None) -> float | None:
        return min(xs) if xs else None

    over, rate = _fit(min(tb), lo(ts), nb, ns)
    noise_b, noise_s = _typical(tb) / min(tb), (_typical(ts) / min(ts) if ts else 1.0)
    fast = [_fit(min(r[0]), lo(r[1]), nb, ns) for _, r in runs]
    f_over = min(o for o, _ in fast)
    f_rate = max(r for _, r in fast)
    desc = (f"measured now: {kname} {m.ggml_type} {shape[0]}x{shape[1]} on {device}"
            + (f", 1 thread typical / best of {', '.join(str(n) for n, _ in runs)} threads"
               if device == "cpu" else f", 30th percentile / best of {len(tb)}"))
    cost = LinearCost(Range(over * noise_s, f_over, desc), Range(rate / noise_b / 1e9, f_rate / 1e9, desc))
    return cost, {"type": m.ggml_type, "shape": shape, "kernel": kname,
                  "runs": {str(n): {"big_s": r[0], "small_s": r[1]} for n, r in runs}}


def host_memory() -> int:
    """Bytes of RAM this process may plan with: physical RAM, or a cgroup limit below it."""
    import psutil

    total = int(psutil.virtual_memory().total)
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(p) as f:
                v = f.read().strip()
            if v.isdigit():
                total = min(total, int(v))
        except OSError:
            continue
    return total


def probe_cpu(mats: Sequence[Matrix], *, budget_s: float = 2.5,
              fused_mats: Sequence[Matrix] = ()) -> tuple[DeviceRates, dict[str, Any]]:
    """CPU dequant+matmul per ggml type (the ones carrying most bytes), memory read bandwidth and
    small-op dispatch on this machine: the slow end single-threaded (its typical run), the fast
    end the best of one thread and torch's thread count. ``fused_mats``: also time these
    quantized matrices (experts, a quantized trunk) through the runtime's compiled one-token
    matvec (``runtime.model.qmatvec``, what ``expertfs run --fused`` uses on the CPU; compiling
    costs seconds the first time in a process)."""
    import torch

    base = stated_cpu()
    types = linear_types(mats, limit=4)
    linear = dict(base.linear)
    n = torch.get_num_threads()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    busy = load is not None and load > (os.cpu_count() or 1) - 0.5
    threads = [n] if n > 1 and not busy else []      # a busy box: threads only measure contention
    detail: dict[str, Any] = {"threads": n, "cpus": os.cpu_count(), "load_average": load,
                              "busy": busy, "linear": []}
    per = budget_s * 0.8 / max(1, len(types))
    for m in types:
        got = _linear_cost(m, "cpu", per, threads=threads)
        if got is not None:
            linear[m.ggml_type] = got[0]
            detail["linear"].append(got[1])
    measured = [linear[m.ggml_type] for m in types
                if m.ggml_type not in FLOAT_TYPES and m.ggml_type in linear and linear[m.ggml_type] is not base.linear.get("*")]
    if measured:                            # any other quantized type: the slowest one measured
        linear["*"] = min(measured, key=lambda c: c.gbps.slow)
    fused: dict[str, LinearCost] = {}
    for m in linear_types(fused_mats, limit=3):
        got = _linear_cost(m, "cpu", per, threads=threads, fused=True)
        if got is not None and got[1]["kernel"] != "formats.dequant.linear":
            fused[m.ggml_type] = got[0]
            detail["linear"].append(got[1])
    buf = torch.ones(32 << 20, dtype=torch.float32)          # 128 MiB
    a, b = torch.ones(2048), torch.ones(2048)

    def ops() -> None:
        for _ in range(200):
            torch.add(a, b)

    old = torch.get_num_threads()
    mem_t, op_t = {}, {}
    try:
        for k in dict.fromkeys([1, *threads]):
            torch.set_num_threads(k)
            mem_t[k] = _times(lambda b=buf: b.sum(), 5, budget_s * 0.05)
            op_t[k] = _times(ops, 7, budget_s * 0.05)
    finally:
        torch.set_num_threads(old)
    gb = buf.numel() * 4 / 1e9
    mem = Range(gb / _typical(mem_t[1]), max(gb / min(t) for t in mem_t.values()),
                "measured now: torch sum over 128 MiB (1 thread typical / best)")
    op = Range(_typical(op_t[1]) / 200, min(min(t) for t in op_t.values()) / 200,
               "measured now: torch.add on 2048 floats")
    del buf
    return DeviceRates("cpu", linear, mem, op, base.sync_s, fused), detail


# ------------------------------------------------------------------------------------------------
# CUDA


def cuda_memory() -> int:
    try:
        import torch
        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        pass
    return 0


def probe_group_layers(g: Any, device: str, budget_s: float, sync=None
                       ) -> tuple[dict[str, LinearCost], list[dict[str, Any]]]:
    """``{layer_key: LinearCost}`` of one decode step through k experts on ``device`` as the
    runtime's device path computes it (``runtime.model.expert_groups.group_rows``: each role
    of the k dequantized in one call, the products over the group at once; bfloat16 off the
    CPU), for each distinct routed-expert layer of the geometry ``g``."""
    import torch

    from ...formats.ggml import GGMLType
    from ...formats.moe_names import Role
    from ..experts.protocol import ExpertWeights, QWeight
    from ..model.expert_groups import group_rows
    from .native import layer_key

    dt = torch.float32 if device == "cpu" else torch.bfloat16
    todo = {layer_key(p, g.k): p for p in g.expert_parts if len(p) in (2, 3)}
    out: dict[str, LinearCost] = {}
    detail: list[dict[str, Any]] = []
    for key, parts in todo.items():
        roles = (Role.GATE_UP, Role.DOWN) if len(parts) == 2 else (Role.GATE, Role.UP, Role.DOWN)
        try:
            ws = [ExpertWeights(0, i, {r: QWeight(_weight_bytes(m.ggml_type, m.rows, m.cols, i)
                                                  .reshape(-1).to(device),
                                                  GGMLType[m.ggml_type], (m.rows, m.cols))
                                       for r, m in zip(roles, parts)}) for i in range(g.k)]
            x = torch.randn(1, parts[0].cols, device=device).to(dt)
            ts = _times(lambda ws=ws, x=x: group_rows(x, ws), 7, budget_s / len(todo), sync)
        except Exception:                      # out of memory, a type without a kernel: stated
            continue
        nb = g.k * sum(m.nbytes for m in parts)
        src = f"measured now: expert_groups.group_rows {key.split('@')[0]} x {g.k} on {device}"
        out[key] = LinearCost(Range(0.0, 0.0, src),
                              Range(nb / _typical(ts) / 1e9, nb / min(ts) / 1e9, src))
        detail.append({"layer": key, "path": "expert_groups.group_rows", "times_s": ts})
    return out, detail


def probe_cuda(mats: Sequence[Matrix], g: Any = None, *, budget_s: float = 3.0
               ) -> tuple[DeviceRates, Range, dict[str, Any]] | None:
    """GPU rates and pinned host->device GB/s on this machine's first CUDA device (None without);
    with the geometry ``g``, its routed-expert layers as the runtime's device path computes
    them (``probe_group_layers``)."""
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(0)
    sync = torch.cuda.synchronize
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dbuf = torch.empty(n, dtype=torch.uint8, device=dev)
    h2d = _range(_times(lambda d=dbuf, h=host: d.copy_(h, non_blocking=True), 5, budget_s * 0.15,
                        sync),
                 n / 1e9, f"measured now: pinned 256 MiB host->device copies to {name}")
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    mem = _range(_times(lambda a=big, b=big2: b.copy_(a), 5, budget_s * 0.15, sync), 2 * big.numel() / 1e9,
                 f"measured now: 1 GiB device copy on {name} (read + write)")
    del big, big2, dbuf, host
    a, b = torch.ones(2048, device=dev), torch.ones(2048, device=dev)

    def ops() -> None:
        for _ in range(200):
            torch.add(a, b)

    t = _times(ops, 7, budget_s * 0.1, sync)
    op = Range(_typical(t) / 200, min(t) / 200, f"measured now: torch.add launches on {name}")
    s = _times(lambda: a.sum().item(), 21, budget_s * 0.1)
    sync_r = Range(_typical(s), min(s), f"measured now: a device->host .item() on {name}")
    from .rates import stated_gpu
    base = stated_gpu([m.ggml_type for m in mats], mem)
    linear = dict(base.linear)
    detail: dict[str, Any] = {"device": name, "linear": []}
    types = linear_types(mats)
    for m in types:
        got = _linear_cost(m, "cuda", budget_s * 0.5 / max(1, len(types)), sync=sync)
        if got is not None:
            linear[m.ggml_type] = got[0]
            detail["linear"].append(got[1])
    layers: dict[str, LinearCost] = {}
    if g is not None:
        layers, detail["layers"] = probe_group_layers(g, "cuda", budget_s * 0.3, sync)
    torch.cuda.empty_cache()
    return DeviceRates("gpu", linear, mem, op, sync_r, layers=layers), h2d, detail
