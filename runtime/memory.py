"""How much memory this process may really use, and a RAM tier that fits in it.

The limit is the smallest of physical RAM and the memory cgroup's cap (v2 ``memory.max`` or
v1 ``memory.limit_in_bytes``), because a container or a ``systemd-run -p MemoryMax=`` box
counts the page cache too: a RAM tier sized from physical RAM inside a small cgroup pushes the
memory-mapped trunk out, and every token then re-reads it from disk. ``EXPERTFS_MEMORY_LIMIT``
sets a cap without a cgroup. ``host_budget`` is the one memory model: ``expertfs run`` sizes
its default RAM tier with it and ``expertfs plan`` reports the same budget, item by item.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..errors import UsageError

__all__ = ["physical_memory", "cgroup_limit", "memory_limit", "limit_and_source", "LIMIT_ENV",
           "default_ram_tier", "RUNTIME_OVERHEAD", "RUNTIME_RESIDENT", "RUNTIME_RESIDENT_PER_LAYER",
           "TOKENIZER_BYTES_PER_TOKEN", "runtime_resident", "RUNTIME_OVERHEAD_CUDA", "KV_GROWTH_PEAK",
           "OS_HEADROOM_MIN", "OS_HEADROOM_FRACTION", "FALLBACK_SLAB", "fallback_slab", "os_headroom",
           "runtime_overhead", "kv_reserve", "HostBudget", "host_budget", "check_budget", "resident_trunk_bytes",
           "SWA_RING_WINDOWS", "SWA_CHECKPOINTS", "swa_ring", "swa_positions",
           "STREAM_IN_FLIGHT", "STREAM_MARGIN", "STREAM_MARGIN_MIN", "trunk_stream_share"]

log = logging.getLogger(__name__)

#: Python, torch, the native kernels, staging buffers and allocator slack beside the RAM tier,
#: the trunk and the KV cache: the CPU runtime's peak resident memory beyond those three, with
#: a margin.
RUNTIME_OVERHEAD = 384 << 20
#: ... plus the CUDA libraries' host side on a GPU run.
RUNTIME_OVERHEAD_CUDA = 1 << 30
#: Of the CPU runtime's overhead, a cap cannot take back the interpreter's and torch's heaps
#: and the engine's tables (with a share per decoder block: its tables, its tensors' objects),
#: with the tokenizer's per vocabulary entry (its pieces, merges and lookups); the rest is the
#: libraries' mapped pages, which a cap below the whole evicts and the run faults back in as it
#: needs them: slower, not killed (``runtime_resident``, ``plan``'s "working_set_evicted"; the
#: floor against runs under caps down to where they die: ``bench/working_set.py``).
RUNTIME_RESIDENT = 180 << 20
RUNTIME_RESIDENT_PER_LAYER = 256 << 10
TOKENIZER_BYTES_PER_TOKEN = 384
#: Left to the OS and other processes when the limit is the machine's RAM (no cap): an eighth
#: of it, at least 3 GiB (a quarter of a smaller box).
OS_HEADROOM_MIN = 3 << 30
OS_HEADROOM_FRACTION = 0.125
#: A cap to plan under without a cgroup (``EXPERTFS_MEMORY_LIMIT=6G``): read by ``expertfs run``
#: and ``expertfs plan`` as a cgroup cap would be.
LIMIT_ENV = "EXPERTFS_MEMORY_LIMIT"
#: The host KV cache's peak against its size at the context limit. It grows by doubling, one
#: layer's tensor at a time, each new one an anonymous mapping whose pages exist only where the
#: copy writes them (``model.attention.cache_zeros``), so a growth never holds more than the
#: full cache will; the margin is what a decode step at the full context holds beside it
#: (measured by ``bench/state_at_ctx.py``, figures in bench/README.md).
KV_GROWTH_PEAK = 1.05
#: A sliding-window layer keeps a ring of this many windows of positions: the window, and as
#: many more to roll back to (a new request that shares a prefix with the last one).
SWA_RING_WINDOWS = 2
#: ... and, when the context is longer than its ring, this many copies of the ring taken one
#: window after a prompt's end, so a later request can go back to where that prompt ended.
SWA_CHECKPOINTS = 2
_UNLIMITED = 1 << 60
#: Where the limit cannot hold the quantized trunk (the fallback tier), ``runtime.model.
#: trunk_stream`` streams a share of every layer's matrices a token: units (a layer's, the
#: output head's) whose streamed bytes are in memory at once (the one computing and the next,
#: read ahead) ...
STREAM_IN_FLIGHT = 2
#: ... and what it streams beyond the deficit it measures: a share of it, at least a floor
#: (kept bytes found missing later add to the deficit; what it streams it re-reads a token).
STREAM_MARGIN = 0.125
STREAM_MARGIN_MIN = 32 << 20


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_limit() -> int | None:
    """This process's memory cgroup cap in bytes, or None when there is none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and ctrls == "":                      # cgroup v2
            v = _read_int(f"/sys/fs/cgroup{path}/memory.max")
        elif "memory" in ctrls.split(","):                  # cgroup v1
            v = _read_int(f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        else:
            continue
        if v is not None and v < _UNLIMITED // 2:
            limits.append(v)
    return min(limits) if limits else None


def _env_limit() -> int | None:
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return None
    from ..units import parse_size
    try:
        v = parse_size(text)
    except ValueError:
        raise UsageError(f"{LIMIT_ENV}={text!r} is not a size",
                         fix=f"set {LIMIT_ENV} to a size such as 8G, or unset it") from None
    if v <= 0:
        raise UsageError(f"{LIMIT_ENV}={text!r}", fix=f"set {LIMIT_ENV} to a positive size")
    return v


def limit_and_source() -> tuple[int, str]:
    """(bytes this process may use, where the figure comes from): ``"env"``
    (``EXPERTFS_MEMORY_LIMIT``), ``"cgroup"`` or ``"physical"``, the smallest of them."""
    phys = physical_memory()
    best = (phys, "physical")
    for v, src in ((cgroup_limit(), "cgroup"), (_env_limit(), "env")):
        if v is not None and v < best[0]:
            best = (v, src)
    return best


def memory_limit() -> int:
    return limit_and_source()[0]


def os_headroom(limit: int, source: str = "physical") -> int:
    """Memory the run leaves to the OS and other processes: none under a cap (a cgroup, the
    environment variable, a plan's ``--memory-limit``: the cap is this process's own), else
    an eighth of RAM, at least 3 GiB (a quarter on boxes under 12 GiB)."""
    if source != "physical":
        return 0
    return max(int(limit * OS_HEADROOM_FRACTION), min(OS_HEADROOM_MIN, limit // 4))


def runtime_overhead(cuda: bool = False) -> int:
    """The runtime's own resident memory beside the tiers, the trunk and the KV cache."""
    return RUNTIME_OVERHEAD + (RUNTIME_OVERHEAD_CUDA if cuda else 0)


def runtime_resident(n_vocab: int, n_layers: int) -> int:
    """The part of a CPU run's ``runtime_overhead`` a cap cannot evict, for a vocabulary of
    ``n_vocab`` and ``n_layers`` decoder blocks (NextN's included): below it, with the KV
    cache the run writes, the workspace and the smallest tier, the run is killed or never
    finishes."""
    return min(RUNTIME_OVERHEAD, RUNTIME_RESIDENT + RUNTIME_RESIDENT_PER_LAYER * n_layers
               + TOKENIZER_BYTES_PER_TOKEN * n_vocab)


def swa_ring(window: int, n_ctx: int) -> int:
    """Positions in a sliding-window layer's ring at context ``n_ctx``."""
    return max(1, min(n_ctx, SWA_RING_WINDOWS * window))


def swa_positions(window: int, n_ctx: int) -> int:
    """Positions a sliding-window layer holds at context ``n_ctx``: its ring, and the ring's
    checkpoints when the ring is shorter than the context."""
    ring = swa_ring(window, n_ctx)
    return ring * (1 + SWA_CHECKPOINTS) if n_ctx > ring else min(ring, max(0, n_ctx))


def kv_reserve(kv_bytes: int, state_bytes: int = 0) -> int:
    """Host memory to keep for a KV cache of ``kv_bytes`` at the context limit: its growth peak
    (``KV_GROWTH_PEAK``); ``state_bytes`` of it (recurrent layers' fixed state) do not grow."""
    state = min(max(0, state_bytes), kv_bytes)
    return int((kv_bytes - state) * KV_GROWTH_PEAK) + state


_LABEL = {"kv_cache": "KV cache", "os_headroom": "OS headroom"}

#: The RAM tier ``expertfs run`` takes when its budget leaves less than the tier it needs
#: (``HostBudget.default_tier``): it runs anyway, the cap then evicting the quantized trunk's
#: file pages, re-read from the drive. ``expertfs plan`` predicts that same run.
FALLBACK_SLAB = 64 << 20


def fallback_slab(slot_bytes: int, k: int) -> int:
    """The RAM tier ``run`` takes when its budget leaves too little: ``FALLBACK_SLAB``, or one
    layer's ``k`` experts of ``slot_bytes`` where that is more (a CPU run computes a layer's
    experts from the tier)."""
    return max(FALLBACK_SLAB, k * slot_bytes)


@dataclass(frozen=True)
class HostBudget:
    """Host memory of one run, every byte named: what the limit holds beside the RAM tier, and
    the default tier (``slab``: what ``expertfs run`` takes as its ``--ram`` by default, the
    staging slots of a GPU run included)."""

    limit: int
    source: str                    # "physical" | "cgroup" | "env" | "limit" (given)
    headroom: int
    runtime: int
    trunk: int
    kv: int                        # the KV cache's reserve (growth peak), state included
    workspace: int = 0
    staging: int = 0               # GPU runs: read slots carved from the slab
    experts: int | None = None     # bytes of every expert the tier could hold (None: unbounded)

    @property
    def fixed(self) -> int:
        return self.headroom + self.runtime + self.trunk + self.kv + self.workspace

    @property
    def room(self) -> int:
        """What the limit leaves for the slab (may be negative)."""
        return self.limit - self.fixed

    def default_tier(self, slot_bytes: int, k: int, need: int) -> int:
        """The RAM tier ``expertfs run`` takes by default: the slab, or where it holds fewer
        than ``need`` experts of ``slot_bytes`` (``k`` where a run computes a layer's experts
        from it, one where they are staged on their way to a VRAM tier) the fallback tier, the
        cap evicting trunk pages instead, as ``plan`` predicts ("trunk_evicted")."""
        return self.slab if self.slab >= need * slot_bytes else fallback_slab(slot_bytes, k)

    @property
    def slab(self) -> int:
        room = max(0, self.room)
        return room if self.experts is None else min(room, self.experts + self.staging)

    def items(self) -> list[tuple[str, int]]:
        return [("os_headroom", self.headroom), ("runtime", self.runtime), ("trunk", self.trunk),
                ("kv_cache", self.kv), ("workspace", self.workspace)]

    def warning(self, ram_bytes: int, need: int = 0) -> str | None:
        """A warning when a slab of ``ram_bytes`` and the rest exceed the limit; ``need``: the
        smallest tier a run can take (one layer's experts), below which no ``--ram`` fits."""
        if ram_bytes <= self.room:
            return None
        parts = " + ".join(f"{_LABEL.get(name, name)} {n >> 20} MiB"
                           for name, n in self.items()[1:] if n)
        head = f" (after {self.headroom >> 20} MiB left to the OS)" if self.headroom else ""
        if self.room <= 0 or self.room < need:
            room = ("leave no room for a RAM tier" if self.room <= 0 else
                    f"leave {self.room >> 20} MiB, less than one layer's experts "
                    f"({need >> 20} MiB),")
            out = ("the trunk is evicted and re-read from disk as tokens need it"
                   if ram_bytes <= self.room + self.trunk else
                   "the trunk and the runtime's own library pages are evicted and read again as "
                   "each call needs them: the drive thrashes and decode is far slower")
            return (f"{parts} {room} in this process's memory limit of "
                    f"{self.limit >> 20} MiB{head}: with a {ram_bytes >> 20} MiB tier {out} (or "
                    f"the process killed); a larger limit, a smaller --ctx or --batch, or a "
                    f"smaller model avoid it")
        return (f"RAM tier {ram_bytes >> 20} MiB + {parts} exceed this process's memory limit "
                f"of {self.limit >> 20} MiB{head}: the trunk would be evicted and re-read from "
                f"disk every token (or the process killed); use --ram {max(0, self.room) >> 20}M "
                f"or less, or a smaller --ctx")


def host_budget(trunk_bytes: int, kv_bytes: int = 0, *, state_bytes: int = 0,
                workspace: int = 0, staging: int = 0, cuda: bool = False,
                experts: int | None = None, limit: int | None = None,
                source: str | None = None) -> HostBudget:
    """The host budget of a run: ``limit`` (default: this process's, ``limit_and_source``; a
    given one counts as a cap unless ``source`` says "physical"), less the OS headroom, the
    runtime, the trunk, the KV cache's reserve and the workspace. ``expertfs run`` and
    ``expertfs plan`` both size the RAM tier with this function."""
    if limit is None:
        limit, src = limit_and_source()
        source = source or src
    source = source or "limit"
    return HostBudget(limit, source, os_headroom(limit, source), runtime_overhead(cuda),
                      max(0, trunk_bytes), kv_reserve(kv_bytes, state_bytes), max(0, workspace),
                      max(0, staging), experts)


def default_ram_tier(trunk_bytes: int, limit: int | None = None, cap: int | None = None,
                     kv_bytes: int = 0, **kw) -> int:
    """``host_budget(...).slab``, at most ``cap`` and never below 64 MiB or every expert (the
    caller says when that is too small)."""
    b = host_budget(trunk_bytes, kv_bytes, limit=limit, **kw)
    floor = 64 << 20 if b.experts is None else min(64 << 20, b.experts + b.staging)
    return max(floor, b.slab if cap is None else min(cap, b.slab))


def check_budget(ram_bytes: int, trunk_bytes: int, limit: int | None = None,
                 kv_bytes: int = 0, need: int = 0, **kw) -> str | None:
    """A warning when the RAM tier, the trunk, the KV cache and the runtime exceed the memory
    limit (``need``: as ``HostBudget.warning``)."""
    return host_budget(trunk_bytes, kv_bytes, limit=limit, **kw).warning(ram_bytes, need)


def resident_trunk_bytes(store) -> int:
    """Trunk bytes the forward pass keeps touching on the CPU: all of ``trunk.bin`` except the
    token embedding when the output head has its own matrix. The trunk is mapped from the file
    and the embedding is read a row per token, so its pages are not resident (150k-token
    vocabularies make that 0.6-1.2 GB); a tied embedding is the output head, read every token."""
    records = store.trunk_tensors()
    total = int(store.summary.get("trunk_file_bytes", 0))
    emb = records.get("token_embd.weight")
    if emb is not None and "output.weight" in records:
        total -= int(emb.nbytes)
    return max(0, total)


def trunk_stream_share(units: list[int], deficit: int) -> float:
    """The share of each unit's streamed matrices (``units``: their bytes, in the order a token
    uses them, the output head last) that ``runtime.model.trunk_stream`` reads every token so
    that the rest, and the ``STREAM_IN_FLIGHT`` units' streamed share in memory at once, fit in
    the trunk's bytes less ``deficit`` (with ``STREAM_MARGIN``): 0 without a deficit, 1 where
    even that is not enough (every matrix streamed, in order)."""
    if deficit <= 0 or not units:
        return 0.0
    total, n = sum(units), len(units)
    w = min(STREAM_IN_FLIGHT, n)
    peak = max(sum(units[(i + j) % n] for j in range(w)) for i in range(n))
    want = deficit + max(STREAM_MARGIN_MIN, int(deficit * STREAM_MARGIN))
    return 1.0 if total - peak <= want else want / (total - peak)
