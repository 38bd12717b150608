"""``expertfs plan`` as arithmetic: a memory budget and a decode tokens/s range for one box.

Pure: no file is read and nothing is timed here. The inputs arrive as plain values —
``Geometry`` (the model, from ``plan.model``), ``Box`` (RAM, VRAM, context), ``Rates`` (what
each device does per second: measured by ``plan.probe``, read from a ``bench io`` profile, or a
stated default, each carrying its source) and ``RoutingRange`` (hit rates from the cache
simulator at the planned tier sizes, ``plan.routing``) — and every number that comes out is
named, so a measured run can later be set against each term.

**Placements** are what ``expertfs run`` executes: ``gpu`` (trunk, KV cache and experts
computed on the GPU; a VRAM tier above a RAM tier) or ``cpu`` (everything on the CPU, one RAM
tier); ``hybrid`` (trunk and KV cache on the CPU, experts on the GPU) is planned too but only
reported as an alternative, since the runtime runs trunk and experts on one device. The trunk
is either ``float`` (dequantized at load into the compute dtype: bfloat16 on CUDA, float32 on
CPU — the runtime's default) or ``quant`` (ggml bytes, dequantized on every call). ``layout``
budgets one (placement, trunk mode); ``candidates`` all of them; ``choose`` keeps the fastest
predicted one the runtime supports.

**Budget.** RAM: OS headroom (1/8 of RAM, at least 3 GiB or a quarter of a smaller box), the runtime itself, the trunk
and KV cache when they live on the CPU, CPU workspace, on GPU runs the staging slots the
runtime carves from its RAM budget (min(16, k) + 1), then the RAM tier. The tier is pinned when
the host slab fits the pin budget (``EXPERTFS_PIN_BUDGET``, default RAM/4, as the runtime
does): a larger one stays pageable and uploads run at ``PAGEABLE_FACTOR`` of the pinned rate.
VRAM: a reserve (CUDA context, allocator slack), the trunk and KV cache, workspace with one
layer's experts in flight, then the VRAM tier. A tier smaller than one layer's route (k
experts) is no tier.

**Prediction.** Per token, each term in seconds, at a *slow* and a *fast* end:

- ``storage``: NVMe bytes per token (expert extents × miss rate, from the simulator) / storage
  GB/s at the engine's access pattern (whole-extent random reads);
- ``pcie``: host→device bytes (RAM-tier hits and misses uploaded) or VRAM→RAM demotions,
  whichever is larger (the link is full duplex) / PCIe GB/s (GPU runs);
- ``experts``: the k routed experts of every MoE layer through dequant+matmul, each call
  ``overhead + bytes / GB/s`` of the device computing them;
- ``trunk``: every trunk matrix read per token (attention, shared experts, dense FFNs, router,
  output head; not the embedding lookup, not the NextN block), float or quantized;
- ``attention``: reading the KV cache at the context length (slow end: a full ``ctx``; fast
  end: a quarter of it) at the device's memory bandwidth;
- ``expert_overhead``: the runtime's work per routed expert beyond its matrix products
  (provider, weight views, activation, weighted sum), a stated per-expert cost;
- ``dispatch``: per-layer small torch ops (norms, RoPE, softmax, top-k, residuals) and
  device synchronisations.

slow s/token = the sum of every term at pessimistic rates (nothing overlaps); fast s/token =
the largest of storage, pcie and compute (everything else summed) at optimistic rates (perfect
prefetch overlaps reads with compute). tokens/s low–high = 1/slow – 1/fast. The dominant term
is the largest one at each end. Prefill, MTP drafts and the cold first tokens are not modelled.

A ``Range`` carries the value used for the slow end and the one used for the fast end, so a
bandwidth has ``slow < fast`` and a per-call overhead ``slow > fast``.

This module is the budget (the model's geometry is ``plan.geometry``); ``plan.predict`` holds
the rates, the prediction, the
advice and the choice between placements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ...errors import UsageError
from .geometry import (DTYPE_BYTES, KV_TYPES, Geometry, Matrix, kv_bytes_per_token,
                            kv_cache_bytes)

__all__ = ["SCHEMA", "GiB", "MiB", "Range", "Matrix", "Geometry", "Box", "Item", "Pool",
           "Placement", "Memory", "Note", "KV_TYPES", "PLACEMENTS", "TRUNK_MODES", "ASSUMPTIONS",
           "DTYPE_BYTES", "kv_bytes_per_token", "kv_cache_bytes", "os_headroom", "workspace_bytes",
           "layout", "candidates", "max_ctx_on_gpu"]

SCHEMA = "expertfs.store.plan/1"
GiB = 1 << 30
MiB = 1 << 20

# --- stated assumptions: every constant the budget and the prediction use, reported in --json --
OS_HEADROOM_MIN = 3 * GiB          # never give the OS less (page cache, desktop, other processes)
OS_HEADROOM_FRACTION = 0.125       # ... or an eighth of RAM, whichever is larger
RUNTIME_HOST = 768 * MiB           # python, torch, numpy, lmdb, the store index
RUNTIME_HOST_CUDA = 1 * GiB        # plus the CUDA libraries' host side on a GPU run
VRAM_RESERVE_MIN = 1 * GiB         # CUDA context, allocator slack, a display
VRAM_RESERVE_FRACTION = 0.05
PIN_BUDGET_FRACTION = 0.25         # runtime default pin budget: a quarter of RAM
PAGEABLE_FACTOR = 0.5              # uploads from pageable memory run at about half the pinned rate
QUEUE_DEPTH = 16                   # the runtime's read queue depth; staging = min(qd, k) + 1 slots
CPU_DEQUANT_CHUNK = 1 << 20        # formats.dequant.linear's CPU chunk (elements)
GPU_DEQUANT_CHUNK = 1 << 26        # assumed chunk on the GPU (linear dequantizes whole matrices today)
DEQUANT_BYTES_PER_ELEMENT = 6      # float32 dequant + a float16/bfloat16 copy per chunk element
GPU_TRAFFIC_PER_ELEMENT = 6        # GPU dequant-then-matmul memory traffic beyond the quantized bytes
OPS_PER_LAYER = 60                 # small torch ops per decoder layer (norms, rope, softmax, top-k, ...)
#: runtime work per routed expert beyond its matrix products (provider get/release, weight views,
#: silu*mul, weighted sum, compiled-kernel guards), seconds: calibrated once against expertfs run
#: on the demo store (8 x 8 experts per token) on the 2-core development VM, 1 thread: 81 ms per
#: token measured in steady state against 40 ms of kernel time, i.e. ~0.6 ms per expert
EXPERT_OVERHEAD_S = (600e-6, 200e-6)
ATTENTION_FAST_FRACTION = 0.25     # fast end reads the KV cache at this share of ctx
PLACEMENTS = ("gpu", "hybrid", "cpu")
TRUNK_MODES = ("float", "quant")

ASSUMPTIONS: dict[str, Any] = {
    "os_headroom": f"max({OS_HEADROOM_FRACTION:g} x RAM, min({OS_HEADROOM_MIN // GiB} GiB, RAM / 4)) "
                   "unless --headroom",
    "runtime_host_bytes": RUNTIME_HOST, "runtime_host_cuda_bytes": RUNTIME_HOST_CUDA,
    "vram_reserve": f"max({VRAM_RESERVE_MIN // GiB} GiB, {VRAM_RESERVE_FRACTION:g} x VRAM)",
    "pin_budget": f"{PIN_BUDGET_FRACTION:g} x RAM unless --pin-budget (EXPERTFS_PIN_BUDGET)",
    "pageable_upload_factor": PAGEABLE_FACTOR, "staging_slots": f"min({QUEUE_DEPTH}, k) + 1 on GPU runs",
    "compute_dtype": "bfloat16 on the GPU, float32 on the CPU (the runtime's auto dtype)",
    "cpu_dequant_chunk_elements": CPU_DEQUANT_CHUNK, "gpu_dequant_chunk_elements": GPU_DEQUANT_CHUNK,
    "dequant_bytes_per_element": DEQUANT_BYTES_PER_ELEMENT,
    "gpu_traffic_bytes_per_element": GPU_TRAFFIC_PER_ELEMENT,
    "ops_per_layer": OPS_PER_LAYER, "attention_fast_fraction_of_ctx": ATTENTION_FAST_FRACTION,
    "expert_overhead_s": {"slow": EXPERT_OVERHEAD_S[0], "fast": EXPERT_OVERHEAD_S[1],
                          "source": "calibrated once: expert run on the demo store, 2-core VM"},
    "tiers": "exclusive (an expert is in VRAM or in RAM), slots of the largest extent",
    "kv_cache": "decoder layers only (not NextN); MLA caches the latent (kv_lora_rank + rope dims); "
                "sliding-window layers hold min(ctx, window) positions; auto type = compute dtype",
    "choice": "the placement and trunk mode with the highest predicted sqrt(low x high) tok/s "
              "among those expert run supports",
    "not_modelled": "prefill, MTP/draft verification, the cold first tokens, NUMA, thermal throttling",
}


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


def os_headroom(ram: int) -> int:
    """RAM left to the OS: an eighth of RAM, at least 3 GiB (a quarter on boxes under 12 GiB)."""
    return max(int(ram * OS_HEADROOM_FRACTION), min(OS_HEADROOM_MIN, ram // 4))


def workspace_bytes(g: Geometry, ctx: int, device: str) -> int:
    """Activations and temporaries of one decode step on ``device`` ("cpu" or "gpu"): a dequant
    chunk, the logits, attention scores at ``ctx``, hidden states."""
    chunk = CPU_DEQUANT_CHUNK if device == "cpu" else GPU_DEQUANT_CHUNK
    dequant = min(g.largest_matrix_elements, chunk) * DEQUANT_BYTES_PER_ELEMENT
    logits = g.n_vocab * 4
    scores = 2 * g.n_head * ctx * 4
    hidden = 16 * max(g.n_embd, max((m.rows for layer in g.expert_parts for m in layer), default=0)) * 4
    return dequant + logits + scores + hidden


# ------------------------------------------------------------------------------------------------
# the box and the memory budget


@dataclass(frozen=True)
class Box:
    ram: int                       # bytes of RAM the run may plan with
    vram: int = 0                  # bytes of VRAM (0: CPU-only)
    ctx: int = 8192
    kv_type: str = "auto"          # "auto": the compute dtype of the device holding the cache
    headroom: int | None = None    # OS headroom override
    pin_budget: int | None = None  # pinned-memory limit (None: the runtime's RAM/4)
    label: str = ""                # "this machine's RAM and VRAM", "as given"

    def __post_init__(self) -> None:
        if self.ram <= 0:
            raise UsageError(f"RAM {self.ram} bytes", fix="give --ram a size such as 32G")
        if self.vram < 0:
            raise UsageError(f"VRAM {self.vram} bytes", fix="give --vram a size such as 24G, or 0")
        if self.ctx < 1:
            raise UsageError(f"context length {self.ctx}", fix="give --ctx 1 or more")
        if self.kv_type != "auto" and self.kv_type not in KV_TYPES:
            raise UsageError(f"KV cache type {self.kv_type!r} is not known",
                             fix=f"use auto or one of {', '.join(KV_TYPES)}")
        if self.headroom is not None and not 0 <= self.headroom < self.ram:
            raise UsageError(f"headroom {self.headroom} bytes of {self.ram} of RAM",
                             fix="give --headroom below --ram")
        if self.pin_budget is not None and self.pin_budget < 0:
            raise UsageError(f"pin budget {self.pin_budget}", fix="give --pin-budget >= 0")

    @property
    def pin_limit(self) -> int:
        return self.pin_budget if self.pin_budget is not None else int(self.ram * PIN_BUDGET_FRACTION)


@dataclass(frozen=True)
class Item:
    name: str
    nbytes: int
    note: str = ""


@dataclass(frozen=True)
class Pool:
    """One memory (RAM or VRAM): what is set aside, then the expert tier, then what is left."""

    name: str
    total: int
    items: tuple[Item, ...]            # fixed uses, in order
    tier_bytes: int                    # slots x slot bytes
    tier_slots: int
    tier_note: str = ""

    @property
    def fixed(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def unused(self) -> int:
        return self.total - self.fixed - self.tier_bytes

    def item(self, name: str) -> int:
        return sum(i.nbytes for i in self.items if i.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {"total_bytes": self.total,
                "items": [{"name": i.name, "bytes": i.nbytes, "note": i.note} for i in self.items],
                "fixed_bytes": self.fixed, "tier_bytes": self.tier_bytes,
                "tier_experts": self.tier_slots, "tier_note": self.tier_note,
                "unused_bytes": self.unused}


@dataclass(frozen=True)
class Placement:
    where: str                         # "gpu" | "hybrid" | "cpu"
    trunk_mode: str                    # "float" | "quant"

    def __post_init__(self) -> None:
        if self.where not in PLACEMENTS or self.trunk_mode not in TRUNK_MODES:
            raise UsageError(f"placement {self.where}/{self.trunk_mode}",
                             fix=f"use one of {', '.join(PLACEMENTS)} and {', '.join(TRUNK_MODES)}")

    @property
    def trunk(self) -> str:            # device holding and running the trunk and KV cache
        return "gpu" if self.where == "gpu" else "cpu"

    @property
    def experts(self) -> str:          # device computing the routed experts
        return "cpu" if self.where == "cpu" else "gpu"

    @property
    def gpu(self) -> bool:
        return self.where != "cpu"

    @property
    def supported(self) -> bool:       # expertfs run runs trunk and experts on one device
        return self.where != "hybrid"

    @property
    def name(self) -> str:
        return f"{self.where}/{self.trunk_mode}"

    def as_dict(self) -> dict[str, Any]:
        return {"where": self.where, "trunk_mode": self.trunk_mode, "trunk": self.trunk,
                "experts": self.experts, "gpu": self.gpu, "supported": self.supported}


@dataclass(frozen=True)
class Note:
    level: str                         # "error" (cannot run), "warning", "info"
    code: str
    text: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Memory:
    placement: Placement
    ram: Pool
    vram: Pool | None
    kv_bytes: int
    kv_type: str
    trunk_bytes: int                   # resident trunk (float or quant) on its device
    runnable: bool
    pinned: bool = False               # the host slab (RAM tier + staging) is pinned
    staging_slots: int = 0
    notes: tuple[Note, ...] = ()

    @property
    def tier_slots(self) -> tuple[int, int]:
        """(VRAM slots, RAM slots) for the simulator."""
        return (self.vram.tier_slots if self.vram is not None else 0, self.ram.tier_slots)

    @property
    def host_slab(self) -> int:
        """What ``expertfs run --ram`` gets: the RAM tier plus the staging slots."""
        return self.ram.tier_bytes + self.ram.item("staging")


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def max_ctx_on_gpu(g: Geometry, vram_free_for_kv: int, kv_type: str) -> int:
    """The longest context whose KV cache fits in ``vram_free_for_kv`` bytes (0 if none)."""
    if vram_free_for_kv <= 0:
        return 0
    lo, hi = 0, max(1, g.n_ctx_train) * 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv_cache_bytes(g, mid, kv_type) <= vram_free_for_kv:
            lo = mid
        else:
            hi = mid - 1
    return lo


def layout(g: Geometry, box: Box, where: str, trunk_mode: str) -> Memory:
    """Budget ``box`` for one placement and trunk mode; ``runnable`` False (with an error note
    saying what is missing) when it cannot hold it."""
    pl = Placement(where, trunk_mode)
    notes: list[Note] = []
    slot, k = g.slot_bytes, g.k
    dev = pl.trunk
    kv_type = box.kv_type if box.kv_type != "auto" else ("bf16" if dev == "gpu" else "f32")
    kv = kv_cache_bytes(g, box.ctx, kv_type)
    trunk = g.trunk_resident(trunk_mode, DTYPE_BYTES[dev])
    kv_note = (f"{box.ctx} positions x {kv_bytes_per_token(g, kv_type) / 1024:.0f} KiB "
               f"({kv_type}{', MLA latent' if g.mla_latent else ''})")
    t_note = (f"{trunk_mode}: " + ("dequantized at load to " + ("bfloat16" if dev == "gpu" else "float32")
                                   if trunk_mode == "float" else "ggml bytes, dequantized per call"))
    runnable = True

    vram_pool = None
    vslots = 0
    if pl.gpu:
        if box.vram <= 0:
            raise UsageError(f"placement {where} needs a GPU", fix="give --vram")
        reserve = max(VRAM_RESERVE_MIN, int(box.vram * VRAM_RESERVE_FRACTION))
        items = [Item("reserve", reserve, "CUDA context, allocator slack, display")]
        if where == "gpu":
            items += [Item("trunk", trunk, t_note), Item("kv_cache", kv, kv_note)]
        items.append(Item("workspace", workspace_bytes(g, box.ctx, "gpu") + k * slot,
                          f"activations, logits, dequant chunk, {k} experts in flight"))
        fixed_dev = sum(i.nbytes for i in items)
        if fixed_dev > box.vram:
            runnable = False
            base = reserve + workspace_bytes(g, box.ctx, "gpu") + k * slot
            if where == "hybrid" or base > box.vram:
                notes.append(Note("error", "vram_too_small",
                                  f"--vram {_gib(box.vram)} cannot hold the reserve, workspace and "
                                  f"one layer's {k} experts ({_gib(base)})"))
            elif base + trunk > box.vram:
                notes.append(Note("error", "trunk_not_in_vram",
                                  f"the trunk alone needs {_gib(trunk)} ({trunk_mode}) of "
                                  f"{_gib(box.vram)} VRAM ({_gib(box.vram - base)} after the reserve "
                                  "and workspace): keep the trunk in RAM and give --vram to "
                                  f"experts only; a GPU with {_gib(fixed_dev + k * slot)} or more "
                                  "would hold the trunk and KV cache too"))
            else:
                ctx_max = max_ctx_on_gpu(g, box.vram - base - trunk, kv_type)
                notes.append(Note("error", "kv_not_in_vram",
                                  f"the trunk ({_gib(trunk)}, {trunk_mode}) fits in VRAM but not with "
                                  f"the KV cache at --ctx {box.ctx} ({_gib(kv)})"
                                  + (f"; with --ctx {ctx_max} or less both fit" if ctx_max else "")))
        else:
            vslots = min(_tier_slots(box.vram - fixed_dev, slot, k), g.n_decode_experts)
        tnote = ("every expert fits in VRAM" if vslots == g.n_decode_experts else
                 "" if vslots else "below one layer's experts: no VRAM tier")
        vram_pool = Pool("vram", box.vram, tuple(items), vslots * slot, vslots, tnote)

    headroom = box.headroom if box.headroom is not None else os_headroom(box.ram)
    h_note = "--headroom" if box.headroom is not None else (
        f"RAM/8, at least min({OS_HEADROOM_MIN // GiB} GiB, RAM/4)")
    ram_items = [Item("os_headroom", headroom, h_note),
                 Item("runtime", RUNTIME_HOST + (RUNTIME_HOST_CUDA if pl.gpu else 0),
                      "python, torch" + (", CUDA host side" if pl.gpu else ""))]
    if dev == "cpu":
        ram_items += [Item("trunk", trunk, t_note), Item("kv_cache", kv, kv_note)]
    if "cpu" in (pl.trunk, pl.experts):
        ram_items.append(Item("workspace", workspace_bytes(g, box.ctx, "cpu"),
                              "CPU activations, logits, dequant chunk"))
    staging = min(QUEUE_DEPTH, k) + 1 if pl.gpu else 0
    if staging:
        ram_items.append(Item("staging", staging * slot,
                              f"{staging} slots: reads on their way to the GPU"))
    fixed_host = sum(i.nbytes for i in ram_items)
    avail = box.ram - fixed_host
    need_tier = 0 if pl.gpu else k            # a CPU run computes from its RAM tier
    if avail < need_tier * slot:
        runnable = False
        need = fixed_host + need_tier * slot
        notes.append(Note("error", "ram_too_small",
                          f"RAM {_gib(box.ram)} cannot hold "
                          + ", ".join(f"{i.name} {_gib(i.nbytes)}" for i in ram_items)
                          + (f" and one layer's {k} experts" if need_tier else "")
                          + f": {_gib(need)} needed"))
    rslots = _tier_slots(avail, slot, k) if runnable else 0
    left = g.n_decode_experts - vslots                  # exclusive tiers: no expert twice
    rnote = ""
    if rslots > left:
        rslots = max(left, k) if left > 0 else 0
        rnote = "every expert fits in the tiers"
    if runnable and pl.gpu and 0 < avail // slot < k:
        notes.append(Note("warning", "ram_tier_below_layer",
                          f"the RAM left for experts ({_gib(avail)}) is below one layer's {k} "
                          f"experts: no RAM tier, every VRAM miss is read from NVMe"))
    pinned = pl.gpu and rslots * slot + staging * slot <= box.pin_limit
    if runnable and pl.gpu and not pinned:
        rnote = (rnote + "; " if rnote else "") + "pageable: above the pin budget"
    ram_pool = Pool("ram", box.ram, tuple(ram_items), rslots * slot, rslots, rnote)
    if runnable:
        tiers = rslots * slot + vslots * slot
        if tiers < g.token_expert_bytes:
            notes.append(Note("warning", "tiers_below_token",
                              f"the expert tiers ({_gib(tiers)}) hold less than one token's experts "
                              f"({_gib(g.token_expert_bytes)} = {k} x {len(g.moe_layers)} layers x "
                              f"{slot / MiB:.1f} MiB): expect disk-bound decode"))
        if rslots + vslots >= g.n_decode_experts:
            notes.append(Note("info", "all_experts_fit",
                              f"every expert ({_gib(g.decode_expert_bytes)}) fits in the tiers: "
                              "after warm-up nothing is read from NVMe"))
        if pl.gpu and not pinned and rslots:
            notes.append(Note("info", "not_pinned",
                              f"the host slab ({_gib(rslots * slot + staging * slot)}: RAM tier + "
                              f"staging) is above the pin budget ({_gib(box.pin_limit)}): the runtime "
                              f"leaves it pageable and uploads run at about {PAGEABLE_FACTOR:.0%} "
                              "speed; EXPERTFS_PIN_BUDGET (plan: --pin-budget) pins it, on a box "
                              "that runs nothing else"))
    if box.ctx > g.n_ctx_train > 0:
        notes.append(Note("warning", "ctx_beyond_training",
                          f"--ctx {box.ctx} is beyond the model's training context {g.n_ctx_train}"))
    return Memory(pl, ram_pool, vram_pool, kv, kv_type, trunk, runnable, pinned, staging,
                  tuple(notes))


def _tier_slots(avail: int, slot: int, k: int) -> int:
    n = max(0, avail) // slot
    return n if n >= k else 0


def candidates(g: Geometry, box: Box, where: str = "auto", trunk_mode: str = "auto") -> list[Memory]:
    """Every (placement, trunk mode) allowed by ``where``/``trunk_mode`` ("auto": all) for
    ``box``, most preferred first (GPU before CPU, float before quant)."""
    wheres = [w for w in PLACEMENTS if (w == "cpu" or box.vram > 0)] if where == "auto" else [where]
    modes = list(TRUNK_MODES) if trunk_mode == "auto" else [trunk_mode]
    for w in wheres:
        if w not in PLACEMENTS:
            raise UsageError(f"placement {w!r}", fix=f"use auto or one of {', '.join(PLACEMENTS)}")
        if w != "cpu" and box.vram <= 0:
            raise UsageError(f"placement {w} needs a GPU", fix="give --vram, or --placement cpu")
    for m in modes:
        if m not in TRUNK_MODES:
            raise UsageError(f"trunk mode {m!r}", fix=f"use auto or one of {', '.join(TRUNK_MODES)}")
    return [layout(g, box, w, m) for w in wheres for m in modes]
