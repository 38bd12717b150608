"""``expertfs plan``'s memory budget for one box: where the trunk, the KV cache and the expert
tiers go, for each placement and trunk mode (see ``plan.assumptions`` for both).

Pure: no file is read and nothing is timed here. The inputs are plain values: ``Geometry``
(the model, ``plan.geometry``) and ``Box`` (RAM, VRAM, context); ``layout`` budgets one
(placement, trunk mode), ``candidates`` all of them, and every byte that comes out is named.

RAM is ``run_host_budget``, the budget ``expertfs run`` sizes its default ``--ram`` with
(``runtime.memory.host_budget``): OS headroom (1/8 of RAM, at least 3 GiB or a quarter of a
smaller box; none under a cap), the runtime itself, the trunk and the KV cache's reserve when
they live on the CPU, CPU workspace, on GPU runs the staging slots the runtime carves from its
RAM budget (min(16, k) + 1), then the RAM tier. The tier is pinned
when the host slab fits the pin budget (``EXPERTFS_PIN_BUDGET``, default RAM/4, as the runtime
does): a larger one stays pageable and uploads run at ``PAGEABLE_FACTOR`` of the pinned rate.
VRAM: a reserve (CUDA context, allocator slack), the trunk and KV cache, workspace with one
layer's experts in flight, then the VRAM tier. A tier smaller than one layer's route (k
experts) is no tier.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ...errors import UsageError
from .. import memory as _memory
from ..cache.sizing import window_slots
from .assumptions import (OS_HEADROOM_MIN, PAGEABLE_FACTOR, PIN_BUDGET_FRACTION, PLACEMENTS,
                          QUEUE_DEPTH, TRUNK_MODES, VRAM_RESERVE_FRACTION,
                          VRAM_RESERVE_MIN, GiB, MiB)
from .geometry import DTYPE_BYTES, KV_TYPES, Geometry, kv_bytes_per_token, kv_cache_bytes
from .host import (LIMIT_SOURCES, budget_batch, cap_fit, os_headroom, run_host_budget,
                   trunk_host_bytes, workspace_bytes)

__all__ = ["Box", "Item", "Pool", "Placement", "Memory", "Note", "os_headroom", "workspace_bytes",
           "layout", "candidates", "max_ctx_on_gpu", "LIMIT_SOURCES", "trunk_host_bytes",
           "run_host_budget"]

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
    limit_source: str = "physical"  # "physical": the box's RAM (OS headroom kept); else a cap
    n_predict: int = 64            # tokens a run generates (run's -n): its first reads spread over them
    prompt_tokens: int = 0         # the prompt before them (its experts loaded before the decode)
    act_quant: str = "off"         # run's --act-quant: the native kernels' numerics
    page_cache: float = 0.0        # share of the experts file in the page cache now: where
                                   # run maps its RAM tier, the start reads only the rest

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
        if self.n_predict < 1:
            raise UsageError(f"{self.n_predict} tokens to generate", fix="give -n 1 or more")
        if self.prompt_tokens < 0:
            raise UsageError(f"a prompt of {self.prompt_tokens} tokens",
                             fix="give --prompt-tokens 0 or more")
        if self.limit_source not in LIMIT_SOURCES:
            raise UsageError(f"memory limit source {self.limit_source!r}",
                             fix=f"use one of {', '.join(LIMIT_SOURCES)}")
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
    trunk_evicted: int = 0             # quantized trunk bytes the cap keeps out of memory
    pages_evicted: int = 0             # ... and of the runtime's library pages (a thrash)

    @property
    def tier_slots(self) -> tuple[int, int]:
        """(VRAM slots, RAM slots) for the simulator."""
        return (self.vram.tier_slots if self.vram is not None else 0, self.ram.tier_slots)

    @property
    def host_slab(self) -> int:
        """What ``expertfs run --ram`` gets: the RAM tier plus the staging slots."""
        return self.ram.tier_bytes + self.ram.item("staging")

    def as_dict(self, g: Geometry) -> dict[str, Any]:
        """``plan --json``'s ``budget``."""
        return {"ram": self.ram.as_dict(), "vram": self.vram.as_dict() if self.vram else None,
                "kv_cache_bytes": self.kv_bytes, "kv_type": self.kv_type,
                "kv_bytes_per_token": kv_bytes_per_token(g, self.kv_type),
                "trunk_resident_bytes": self.trunk_bytes, "trunk_evicted_bytes": self.trunk_evicted,
                "runtime_pages_evicted_bytes": self.pages_evicted,
                "slot_bytes": g.slot_bytes, "staging_slots": self.staging_slots,
                "pinned": self.pinned, "host_slab_bytes": self.host_slab,
                "tier_experts": sum(self.tier_slots), "decode_experts": g.n_decode_experts}


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
               f"({kv_type}{', MLA latent' if g.mla_latent else ''})"
               + (f" + {g.state_bytes / 2**20:.0f} MiB recurrent state" if g.state_bytes else ""))
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

    hb = run_host_budget(g, box.ctx, dev, trunk_mode, experts_on_gpu=pl.experts == "gpu",
                         kv_type=kv_type, limit=box.ram, source=box.limit_source,
                         headroom=box.headroom, batch=budget_batch(box.prompt_tokens))
    h_note = ("--headroom" if box.headroom is not None else
              f"RAM/8, at least min({OS_HEADROOM_MIN // GiB} GiB, RAM/4)"
              if box.limit_source == "physical" else f"none: the limit is a cap ({box.limit_source})")
    ram_items = [Item("os_headroom", hb.headroom, h_note),
                 Item("runtime", hb.runtime, "python, torch, kernels, allocator"
                      + (", CUDA host side" if pl.gpu else "") + " (measured peaks)")]
    if dev == "cpu":
        host_note = t_note + ("" if hb.trunk == trunk else ", untied embedding not resident")
        ram_items += [Item("trunk", hb.trunk, host_note),
                      Item("kv_cache", hb.kv, kv_note + (f", growth peak {_memory.KV_GROWTH_PEAK:g}x"
                                                         if hb.kv > kv else ""))]
    if hb.workspace:
        ram_items.append(Item("workspace", hb.workspace, "CPU activations, logits, dequant chunk"))
    staging = min(QUEUE_DEPTH, k) + 1 if pl.gpu else 0
    if staging:
        ram_items.append(Item("staging", staging * slot,
                              f"{staging} slots: reads on their way to the GPU"))
    fixed_host = sum(i.nbytes for i in ram_items)
    avail = box.ram - fixed_host
    need_tier = 0 if pl.gpu else k            # a CPU run computes from its RAM tier
    short = avail < need_tier * slot
    pages = 0 if pl.gpu else max(0, hb.runtime - _memory.runtime_resident(
        g.n_vocab, g.n_layers + g.n_nextn))
    out, most = (cap_fit(g, kv_type, box.ctx, box.prompt_tokens + box.n_predict, hb, pages,
                         avail, slot, k) if short and trunk_mode == "quant" else (None, None))
    if most is not None:
        notes.append(Note("warning", "ctx_beyond_working_set",
                          f"RAM {_gib(box.ram)} cannot hold the KV cache at --ctx {box.ctx} "
                          f"({_gib(hb.kv)}) beside the run's working set: a run of --prompt-tokens"
                          f" + -n fits, one past about {most} positions is killed or stalls "
                          f"(--ctx {most} keeps it inside)"))
    evicted, pages_out = out or (0, 0)
    if out is not None:
        avail = hb.default_tier(slot, k, need_tier)         # run's: the fallback, trunk re-read
        fix = "more memory, a smaller --ctx or a smaller model avoid it"
        if pages_out:
            notes.append(Note("warning", "working_set_evicted",
                              f"RAM {_gib(box.ram)} is below the run's working set: beside a "
                              f"{avail >> 20} MiB tier the cap keeps the whole trunk and "
                              f"{pages_out >> 20} MiB of the runtime's own library pages out of "
                              "memory, faulted back in as each call needs them: run is far "
                              f"slower, thrashing the drive, or does not finish ({fix})"))
        else:
            notes.append(Note("warning", "trunk_evicted",
                              f"RAM {_gib(box.ram)} leaves no room for one layer's {k} experts "
                              f"beside the trunk: run falls back to a {avail >> 20} MiB tier "
                              f"and the cap keeps {evicted >> 20} MiB of the quantized trunk out of "
                              f"memory, re-read from the drive as tokens need it: expect "
                              f"disk-bound decode ({fix})"))
    elif short:
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
    spare = 0                       # a CPU tier of every expert: the prompt window's slots
    if rslots > left:
        if left > 0 and not pl.gpu and not vslots:
            spare = min(rslots - max(left, k), window_slots(slot, k, g.n_experts))
        rslots = max(left, k) if left > 0 else 0
        rnote = "every expert fits in the tiers" + (f", {spare} spare slots" if spare else "")
    if runnable and pl.gpu and 0 < avail // slot < k:
        notes.append(Note("warning", "ram_tier_below_layer",
                          f"the RAM left for experts ({_gib(avail)}) is below one layer's {k} "
                          f"experts: no RAM tier, every VRAM miss is read from NVMe"))
    pinned = pl.gpu and rslots * slot + staging * slot <= box.pin_limit
    if runnable and pl.gpu and not pinned:
        rnote = (rnote + "; " if rnote else "") + "pageable: above the pin budget"
    ram_pool = Pool("ram", box.ram, tuple(ram_items), (rslots + spare) * slot, rslots, rnote)
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
                  tuple(notes), evicted, pages_out)


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
