"""``expertfs plan``'s rates: what each device does per second (storage at the engine's access
pattern, PCIe, per-device dequant+matmul cost per ggml type, memory bandwidth, dispatch), each a
``Range`` carrying its source: a stated default here, a ``bench io`` profile
(``storage_from_profile``) or a measurement (``plan.probe``, ``plan.storage_probe``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import UsageError
from .assumptions import GPU_TRAFFIC_PER_ELEMENT, MiB

__all__ = ["Range", "LinearCost", "DeviceRates", "Rates", "PCIE_GENS", "STATED_SLOW",
           "stated_storage", "stated_drive",
           "stated_pcie", "stated_cpu", "stated_gpu", "stated_read_cpu", "storage_from_profile",
           "read_cpu_from", "bytes_per_element", "FLOAT_TYPES"]


@dataclass(frozen=True)
class Range:
    """A value for the slow end and one for the fast end, with where it came from."""

    slow: float
    fast: float
    source: str = ""

    def at(self, end: str) -> float:
        return self.slow if end == "slow" else self.fast

    def as_dict(self) -> dict[str, Any]:
        return {"slow": self.slow, "fast": self.fast, "source": self.source}


@dataclass(frozen=True)
class LinearCost:
    """A dequant+matmul call on one device: ``overhead + bytes / (GB/s)``."""

    overhead_s: Range
    gbps: Range

    def seconds(self, nbytes: float, end: str, count: int = 1) -> float:
        return count * (self.overhead_s.at(end) + nbytes / (self.gbps.at(end) * 1e9))

    def as_dict(self) -> dict[str, Any]:
        return {"overhead_s": self.overhead_s.as_dict(), "gbps": self.gbps.as_dict()}


@dataclass(frozen=True)
class DeviceRates:
    """What a device does per second: dequant+matmul per ggml type (``"*"``: any other type),
    memory bandwidth (attention over the KV cache), small-op dispatch, synchronisation."""

    device: str
    linear: Mapping[str, LinearCost]
    mem_gbps: Range
    op_s: Range
    sync_s: Range
    #: the runtime's compiled one-token kernels for quantized matrices (experts, and a quantized
    #: trunk), where measured: they replace ``linear`` for those types
    fused: Mapping[str, LinearCost] = field(default_factory=dict)
    #: a routed-expert layer's k experts in one native call (``runtime.kernels.moe``; on a GPU
    #: one group, ``expert_groups.group_rows``), by ``plan.native.layer_key``: replaces the
    #: per-matrix costs of those layers
    layers: Mapping[str, LinearCost] = field(default_factory=dict)
    #: the runtime's own seconds per decoder layer and per token beyond the products, from a
    #: real decode (``plan.overhead``); None: the stated per-op and per-expert model
    layer_s: Range | None = None
    token_s: Range | None = None

    def cost(self, ggml_type: str) -> LinearCost:
        c = self.linear.get(ggml_type) or self.linear.get("*")
        if c is None:
            raise UsageError(f"no {self.device} rate for {ggml_type}", fix="probe or give a default")
        return c

    def quant_cost(self, ggml_type: str) -> LinearCost:
        """A quantized matrix's product: the fused kernel when there is one, else ``cost``."""
        return self.fused.get(ggml_type) or self.cost(ggml_type)

    def as_dict(self) -> dict[str, Any]:
        return {"linear": {t: c.as_dict() for t, c in self.linear.items()},
                "fused": {t: c.as_dict() for t, c in self.fused.items()},
                "layers": {t: c.as_dict() for t, c in self.layers.items()},
                "layer_s": self.layer_s.as_dict() if self.layer_s else None,
                "token_s": self.token_s.as_dict() if self.token_s else None,
                "mem_gbps": self.mem_gbps.as_dict(), "op_s": self.op_s.as_dict(),
                "sync_s": self.sync_s.as_dict()}


def stated_miss_cpu() -> Range:
    return Range(0.15, 0.05, "stated default: CPU seconds per GB of O_DIRECT reads into memory "
                             "already in use (system calls, completions, the I/O threads' wake-ups)")


def stated_read_cpu() -> Range:
    return Range(0.3, 0.1, "stated default: CPU seconds per GB of O_DIRECT reads (system calls, "
                           "page pinning, completions)")


@dataclass(frozen=True)
class Rates:
    storage: Range                     # GB/s of whole-extent random reads
    pcie: Range                        # GB/s host -> device (pinned)
    cpu: DeviceRates
    gpu: DeviceRates
    #: CPU seconds per GB the process spends reading from the drive (slow, fast end)
    read_cpu: Range = field(default_factory=stated_read_cpu)
    #: CPU seconds per GB of the reader's checksums of an expert's first read (None: not priced)
    verify: Range | None = None
    #: CPU seconds per GB of the decode's reads into slots already in use (its misses)
    miss_cpu: Range = field(default_factory=lambda: stated_miss_cpu())

    def as_dict(self) -> dict[str, Any]:
        return {"storage_gbps": self.storage.as_dict(), "pcie_gbps": self.pcie.as_dict(),
                "cpu": self.cpu.as_dict(), "gpu": self.gpu.as_dict(),
                "read_cpu_s_per_gb": self.read_cpu.as_dict(),
                "verify_s_per_gb": self.verify.as_dict() if self.verify else None,
                "miss_cpu_s_per_gb": self.miss_cpu.as_dict()}


#: pinned host->device GB/s by PCIe generation (x16): what cudaMemcpy reaches, not the line rate
PCIE_GENS: dict[int, tuple[float, float]] = {3: (10.0, 12.5), 4: (20.0, 25.0), 5: (40.0, 50.0)}


#: the slow end of a rate stated as one figure (a spec sheet's figure is its best case)
STATED_SLOW = 0.6


def stated_storage() -> Range:
    return Range(2.0, 4.0, "stated default: a PCIe 4.0 NVMe at expert-sized random reads (peers "
                           "measured 3-6 GB/s O_DIRECT on Gen4, 1-2.7 on VM/WSL disks); measure it: "
                           "expertfs bench io STORE --json > io.json, then --io-profile io.json")


def stated_drive(gbps: tuple[float, ...]) -> Range:
    """``--disk-gbps``: one figure (the fast end; the slow end ``STATED_SLOW`` of it) or a
    range (slow, fast), in GB/s."""
    lo, hi = (STATED_SLOW * gbps[0], gbps[0]) if len(gbps) == 1 else (gbps + (0.0, 0.0))[:2]
    if len(gbps) > 2 or not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
        shown = "-".join(f"{v:g}" for v in gbps)
        raise UsageError(f"--disk-gbps {shown}: not a rate in GB/s",
                         fix="write --disk-gbps as one positive figure (e.g. 7) or a range "
                             "LO-HI (e.g. 3.5-6)")
    return Range(lo, hi, f"--disk-gbps {lo:g}-{hi:g}: the planned box's drive at expert-sized "
                         "random reads, as given")


def stated_pcie(gen: int = 4) -> Range:
    if gen not in PCIE_GENS:
        raise UsageError(f"PCIe generation {gen} is not known", fix="give --pcie 3, 4 or 5")
    lo, hi = PCIE_GENS[gen]
    return Range(lo, hi, f"stated default: PCIe {gen}.0 x16 pinned host->device copies")


#: the float matrix types (no dequantization)
FLOAT_TYPES = ("F32", "F16", "BF16")


def stated_cpu() -> DeviceRates:
    src = ("stated default: torch dequant+matmul at batch 1 on 2 AVX2 cores "
           "(formats.dequant.linear; measure with a store or GGUF, or drop --no-probe)")
    quant = LinearCost(Range(200e-6, 60e-6, src), Range(0.3, 0.8, src))
    plain = LinearCost(Range(50e-6, 10e-6, src), Range(5.0, 15.0, src))
    linear = {"*": quant, **{t: plain for t in FLOAT_TYPES}}
    return DeviceRates("cpu", linear, Range(10.0, 20.0, "stated default: DDR4/DDR5 dual channel, one "
                                                        "process"),
                       Range(5e-6, 2e-6, "stated default: torch eager CPU op"), Range(0.0, 0.0, "none"))


def bytes_per_element(ggml_type: str) -> float:
    from ...formats.ggml import GGMLType, block_size, type_size
    try:
        t = GGMLType[ggml_type]
        return type_size(t) / block_size(t)
    except (KeyError, ValueError, ZeroDivisionError):
        return 0.5625


def stated_gpu(types: Sequence[str], mem: Range | None = None) -> DeviceRates:
    """GPU costs from memory bandwidth: a dequant-then-matmul moves the quantized bytes plus
    ``GPU_TRAFFIC_PER_ELEMENT`` bytes per weight (float dequant written and read back), and
    every call pays launch overhead: the runtime dequantizes a group of k experts' role in one
    call and multiplies the group at once (``runtime.model.expert_groups``), so an expert
    matrix's share is a few launches, not the 20-30 of its own dequantization."""
    mem = mem or Range(500.0, 900.0, "stated default: a 24 GB consumer GPU (RTX 3090/4090 class, "
                                     "~0.94-1.0 TB/s peak)")
    over = Range(30e-6, 10e-6, "stated default: 2-4 torch eager launches an expert matrix, its "
                               "share of a group's (bench/expert_launches.py)")

    def cost(t: str) -> LinearCost:
        bpe = bytes_per_element(t)
        eff = 1.0 if t in FLOAT_TYPES else bpe / (bpe + GPU_TRAFFIC_PER_ELEMENT)
        return LinearCost(over, Range(mem.slow * eff, mem.fast * eff,
                                      f"{mem.source}; x {eff:.3f} for dequant traffic"))

    linear = {t: cost(t) for t in (*types, *FLOAT_TYPES) if t != "*"}
    linear["*"] = cost("Q4_K")
    return DeviceRates("gpu", linear, mem,
                       Range(15e-6, 6e-6, "stated default: CUDA launch from torch eager"),
                       Range(60e-6, 20e-6, "stated default: device->host sync (router read-back)"))


def storage_from_profile(profile: Mapping[str, Any], k: int, *, label: str = "") -> tuple[Range, dict[str, Any]]:
    """Storage GB/s from an ``expertfs bench io --json`` report.

    The engine reads whole extents at random; demand reads of one layer keep about k in flight,
    prefetch more. Backend: what ``auto`` picked in the report, else the one fastest at the slow
    end's depth. Slow end: that backend at the deepest measured queue depth <= k (its shallowest
    if none); fast end: its best point at any depth.
    """
    where = label or "io profile"
    points = profile.get("points") if isinstance(profile, Mapping) else None
    if not isinstance(points, list) or not points:
        raise UsageError(f"{where}: no measured points", fix="pass the JSON of `expertfs bench io "
                         "STORE --json`")
    by: dict[str, list[tuple[int, float, Mapping[str, Any]]]] = {}
    for p in points:
        try:
            b, qd, g = str(p["backend"]), int(p["qd"]), float(p["gbps"])
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{where}: a point lacks backend/qd/gbps",
                             fix="pass the JSON of `expertfs bench io STORE --json`") from None
        if g > 0 and qd > 0:
            by.setdefault(b, []).append((qd, g, p))
    if not by:
        raise UsageError(f"{where}: every point has 0 GB/s", fix="measure again with bench io")
    def shallow(b: str) -> tuple[int, float, Mapping[str, Any]]:
        pts = sorted(by[b], key=lambda p: p[0])
        return ([p for p in pts if p[0] <= k] or pts[:1])[-1]

    auto = profile.get("auto") or {}
    chosen = auto.get("backend") if isinstance(auto, Mapping) else None
    if chosen not in by:                  # no auto choice: the best at the demand-read depth
        chosen = max(by, key=lambda b: shallow(b)[1])
    pts = sorted(by[chosen], key=lambda p: p[0])
    slow_qd, slow, slow_p = shallow(chosen)
    fast_qd, fast, _ = max(pts, key=lambda p: p[1])
    fast = max(fast, slow)
    read = profile.get("read_size")
    src = (f"{where}: {chosen} backend, {slow:.2f} GB/s at qd {slow_qd} (demand reads of one layer) "
           f"to {fast:.2f} GB/s at qd {fast_qd}"
           + (f", reads of {read / MiB:.1f} MiB" if isinstance(read, (int, float)) and read else ""))
    cpu_us, reads, nbytes = (slow_p.get(f) for f in ("cpu_us_per_read", "reads", "bytes"))
    reused = [p.get("cpu_us_per_read") * 1e-6 * p.get("reads") / p.get("bytes") * 1e9
              for _, _, p in pts if p.get("cpu_us_per_read") is not None and p.get("reads")
              and p.get("bytes")]
    detail = {"backend": chosen, "slow_qd": slow_qd, "fast_qd": fast_qd,
              "cpu_s_per_gb": (cpu_us * 1e-6 * reads / nbytes * 1e9
                               if cpu_us is not None and reads and nbytes else None),
              "cpu_s_per_gb_reused": min(reused) if reused else None,
              "cpu_s_per_gb_reused_slow": max(reused) if reused else None,
              "read_size": read, "p99_latency_us_at_slow_qd": (slow_p.get("lat_us") or {}).get("p99"),
              "cold": profile.get("cold")}
    return Range(slow, fast, src), detail


def _cpu_per_gb(d: Mapping[str, Any], fast: str, slow: str) -> tuple[float, float] | None:
    """(slow, fast end) CPU s/GB from ``d[fast]`` and, where it is dearer, ``d[slow]``."""
    x, y = d.get(fast), d.get(slow)
    if not (isinstance(x, (int, float)) and x > 0):
        return None
    return (float(y) if isinstance(y, (int, float)) and y > x else float(x)), float(x)


def read_cpu_from(detail: Mapping[str, Any] | None, where: str) -> Range:
    """The CPU seconds per GB of reads measured with the drive (``storage_from_profile``'s
    ``cpu_s_per_gb``; the slow end ``cpu_s_per_gb_slow`` where measured), else the stated
    default."""
    d = detail or {}
    r = _cpu_per_gb(d, "cpu_s_per_gb", "cpu_s_per_gb_slow")
    into = " into fresh memory" if d.get("cpu_fresh") else ""
    return Range(*r, f"{where}: CPU time of its reads{into}") if r else stated_read_cpu()


def miss_cpu_from(detail: Mapping[str, Any] | None, where: str) -> Range:
    """The CPU seconds per GB of the decode's reads (into slots already in use: the plain
    points of the storage probe, its cheapest the fast end's and its dearest the slow end's),
    else the stated default."""
    r = _cpu_per_gb(detail or {}, "cpu_s_per_gb_reused", "cpu_s_per_gb_reused_slow")
    return (Range(*r, f"{where}: CPU time of its reads into memory in use") if r
            else stated_miss_cpu())
