"""``expertfs plan`` as arithmetic: a memory budget and a decode tokens/s range for one box.

Pure: no file is read and nothing is timed here. The inputs arrive as plain values —
``Geometry`` (the model, from ``plan_model``), ``Box`` (RAM, VRAM, context), ``Rates`` (what
each device does per second: measured by ``plan_probe``, read from a ``bench io`` profile, or a
stated default, each carrying its source) and ``RoutingRange`` (hit rates from the cache
simulator at the planned tier sizes, ``plan_routing``) — and every number that comes out is
named, so a measured run can later be set against each term.

**Budget.** RAM: OS headroom (max(3 GiB, 1/8 of RAM), explicit), the runtime itself, the trunk
and KV cache when they are not on the GPU, compute workspace, I/O staging (2 layers of expert
reads in flight), then the expert tier. A pinned RAM tier (GPU runs) is capped at
``PINNED_CAP`` of RAM: pinned pages cannot be reclaimed, and peers measured oversized
pinned/mlocked caches failing or starving the OS. VRAM: a reserve (CUDA context, allocator
slack), the trunk and KV cache when they fit (else both stay in RAM and run on the CPU),
workspace, device staging, then the VRAM tier. A tier smaller than one layer's route (k
experts) is no tier: it becomes 0 and misses go straight through the staging buffers.

**Prediction.** Per token, each term in seconds, at a *slow* and a *fast* end:

- ``storage``: NVMe bytes per token (expert extents × miss rate, from the simulator) / storage
  GB/s at the engine's access pattern (whole-extent random reads);
- ``pcie``: host→device bytes (RAM-tier hits and misses uploaded) or VRAM→RAM demotions,
  whichever is larger (the link is full duplex) / PCIe GB/s (GPU runs);
- ``experts``: the k routed experts of every MoE layer through dequant+matmul, each call
  ``overhead + bytes / GB/s`` of the device computing them;
- ``trunk``: every trunk matrix read per token (attention, shared experts, dense FFNs, router,
  output head; not the embedding lookup, not the NextN block) the same way;
- ``attention``: reading the KV cache at the context length (slow end: a full ``ctx``; fast
  end: a quarter of it) at the device's memory bandwidth;
- ``dispatch``: per-layer small torch ops (norms, RoPE, softmax, top-k, residuals) and
  device synchronisations.

slow s/token = the sum of every term at pessimistic rates (nothing overlaps); fast s/token =
the largest of storage, pcie and compute (everything else summed) at optimistic rates (perfect
prefetch overlaps reads with compute). tokens/s low–high = 1/slow – 1/fast. The dominant term
is the largest one at each end. Prefill, MTP drafts and the cold first tokens are not modelled.

A ``Range`` carries the value used for the slow end and the one used for the fast end, so a
bandwidth has ``slow < fast`` and a per-call overhead ``slow > fast``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import UsageError

__all__ = ["SCHEMA", "GiB", "Range", "Matrix", "Geometry", "Box", "Item", "Pool", "Placement",
           "Memory", "LinearCost", "DeviceRates", "Rates", "Routing", "RoutingRange", "Term",
           "Prediction", "Note", "Plan", "KV_TYPES", "ASSUMPTIONS", "kv_bytes_per_token",
           "kv_cache_bytes", "os_headroom", "workspace_bytes", "plan_memory", "predict",
           "advise", "make_plan", "plan_to_dict", "stated_storage", "stated_pcie", "stated_cpu",
           "stated_gpu", "storage_from_profile", "max_ctx_on_gpu", "PCIE_GENS"]

SCHEMA = "expertfs.plan/1"
GiB = 1 << 30
MiB = 1 << 20

#: bytes per KV element by cache type (q8_0: 34-byte blocks of 32)
KV_TYPES: dict[str, float] = {"f16": 2.0, "bf16": 2.0, "f32": 4.0, "q8_0": 34 / 32}

# --- stated assumptions: every constant the budget and the prediction use, reported in --json --
OS_HEADROOM_MIN = 3 * GiB          # never give the OS less (page cache, desktop, other processes)
OS_HEADROOM_FRACTION = 0.125       # ... or an eighth of RAM, whichever is larger
RUNTIME_HOST = 768 * MiB           # python, torch, numpy, lmdb, the store index
RUNTIME_HOST_CUDA = 1 * GiB        # plus the CUDA libraries' host side on a GPU run
VRAM_RESERVE_MIN = 1 * GiB         # CUDA context, allocator slack, a display
VRAM_RESERVE_FRACTION = 0.05
PINNED_CAP = 0.5                   # pinned RAM tier at most this share of RAM
STAGING_LAYERS = 2                 # expert reads in flight: this layer's misses + next layer's prefetch
CPU_DEQUANT_CHUNK = 1 << 20        # formats.dequant.linear's CPU chunk (elements)
GPU_DEQUANT_CHUNK = 1 << 26        # assumed chunk on the GPU (linear dequantizes whole matrices today)
DEQUANT_BYTES_PER_ELEMENT = 6      # float32 dequant + a float16/bfloat16 copy per chunk element
GPU_TRAFFIC_PER_ELEMENT = 6        # GPU dequant-then-matmul memory traffic beyond the quantized bytes
OPS_PER_LAYER = 60                 # small torch ops per decoder layer (norms, rope, softmax, top-k, ...)
ATTENTION_FAST_FRACTION = 0.25     # fast end reads the KV cache at this share of ctx

ASSUMPTIONS: dict[str, Any] = {
    "os_headroom": f"max({OS_HEADROOM_MIN // GiB} GiB, {OS_HEADROOM_FRACTION:g} x RAM) unless --headroom",
    "runtime_host_bytes": RUNTIME_HOST, "runtime_host_cuda_bytes": RUNTIME_HOST_CUDA,
    "vram_reserve": f"max({VRAM_RESERVE_MIN // GiB} GiB, {VRAM_RESERVE_FRACTION:g} x VRAM)",
    "pinned_cap_fraction": PINNED_CAP, "staging_layers": STAGING_LAYERS,
    "cpu_dequant_chunk_elements": CPU_DEQUANT_CHUNK, "gpu_dequant_chunk_elements": GPU_DEQUANT_CHUNK,
    "dequant_bytes_per_element": DEQUANT_BYTES_PER_ELEMENT,
    "gpu_traffic_bytes_per_element": GPU_TRAFFIC_PER_ELEMENT,
    "ops_per_layer": OPS_PER_LAYER, "attention_fast_fraction_of_ctx": ATTENTION_FAST_FRACTION,
    "tiers": "exclusive (an expert is in VRAM or in RAM), slots of the largest extent",
    "placement": "trunk and KV cache on the GPU when both fit with the reserve, workspace and "
                 "staging; else both in RAM, computed on the CPU, with experts still on the GPU",
    "kv_cache": "decoder layers only (not NextN); MLA caches the latent (kv_lora_rank + rope dims); "
                "sliding-window layers hold min(ctx, window) positions",
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


# ------------------------------------------------------------------------------------------------
# model geometry


@dataclass(frozen=True)
class Matrix:
    """A weight matrix the forward pass multiplies by: ``rows x cols`` (out x in), ggml bytes."""

    ggml_type: str
    rows: int
    cols: int
    nbytes: int
    count: int = 1                 # how many such matrices (trunk matrices are grouped)

    @property
    def elements(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class Geometry:
    """What the plan needs to know of a model; built by ``plan_model`` from a store, a GGUF or
    a ``--like`` preset."""

    name: str
    arch: str
    source: str                            # "store PATH", "gguf PATH", "--like NAME (quant ...)"
    n_layer: int                           # decoder blocks (NextN blocks not included)
    n_nextn: int
    n_embd: int
    n_head: int
    n_vocab: int
    n_ctx_train: int
    n_expert: int                          # routed experts per MoE layer
    k: int                                 # experts used per token per layer
    moe_layers: tuple[int, ...]            # block index of each decode MoE layer
    expert_bytes: tuple[int, ...]          # payload of one expert, per decode MoE layer
    extent_bytes: tuple[int, ...]          # padded extent (what one read moves), per MoE layer
    expert_parts: tuple[tuple[Matrix, ...], ...]   # one expert's matrices, per MoE layer
    trunk_matrices: tuple[Matrix, ...]     # computed per token (no embedding lookup, no NextN)
    trunk_bytes: int                       # every tensor that is not a routed expert
    embd_bytes: int
    nextn_trunk_bytes: int
    nextn_expert_bytes: int                # experts of NextN blocks (stored, unused in decode)
    total_expert_bytes: int                # all routed experts, NextN included
    kv_heads: tuple[int, ...]              # KV heads per decoder layer
    key_length: int
    value_length: int
    mla_latent: int = 0                    # >0: MLA, elements cached per token per layer
    swa: tuple[bool, ...] = ()             # sliding-window layers (empty: none)
    sliding_window: int = 0
    expert_types: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.moe_layers)
        if not (n and len(self.expert_bytes) == n == len(self.extent_bytes) == len(self.expert_parts)):
            raise UsageError(f"{self.name}: no routed-expert layers to plan for",
                             fix="plan a Mixture-of-Experts model")
        if not 1 <= self.k <= self.n_expert:
            raise UsageError(f"{self.name}: top-k {self.k} with {self.n_expert} experts per layer",
                             fix="the model's expert_used_count is wrong")
        if len(self.kv_heads) != self.n_layer:
            raise UsageError(f"{self.name}: {len(self.kv_heads)} KV head counts for "
                             f"{self.n_layer} layers", fix="the model's metadata is inconsistent")

    @property
    def slot_bytes(self) -> int:
        """One tier slot: the largest extent (slots are fixed-size)."""
        return max(self.extent_bytes)

    @property
    def decode_expert_bytes(self) -> int:
        """Extents of every decode MoE layer's experts (what the tiers could hold)."""
        return sum(b * self.n_expert for b in self.extent_bytes)

    @property
    def token_expert_bytes(self) -> int:
        """Extent bytes one token routes to: k per MoE layer (read whole when nothing is cached)."""
        return self.k * sum(self.extent_bytes)

    @property
    def n_decode_experts(self) -> int:
        return self.n_expert * len(self.moe_layers)

    @property
    def trunk_active_bytes(self) -> int:
        return sum(m.nbytes * m.count for m in self.trunk_matrices)

    @property
    def largest_matrix_elements(self) -> int:
        parts = [m.elements for layer in self.expert_parts for m in layer]
        return max([m.elements for m in self.trunk_matrices] + parts + [0])

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "arch": self.arch, "source": self.source,
            "n_layer": self.n_layer, "n_nextn": self.n_nextn, "moe_layers": len(self.moe_layers),
            "n_expert": self.n_expert, "k": self.k, "n_embd": self.n_embd, "n_head": self.n_head,
            "n_vocab": self.n_vocab, "n_ctx_train": self.n_ctx_train,
            "kv_heads": sorted(set(self.kv_heads)), "key_length": self.key_length,
            "value_length": self.value_length, "mla_latent": self.mla_latent,
            "swa_layers": sum(self.swa), "sliding_window": self.sliding_window,
            "expert_bytes": max(self.expert_bytes), "slot_bytes": self.slot_bytes,
            "decode_expert_bytes": self.decode_expert_bytes,
            "total_expert_bytes": self.total_expert_bytes,
            "nextn_expert_bytes": self.nextn_expert_bytes,
            "token_expert_bytes": self.token_expert_bytes,
            "trunk_bytes": self.trunk_bytes, "trunk_active_bytes": self.trunk_active_bytes,
            "embd_bytes": self.embd_bytes, "nextn_trunk_bytes": self.nextn_trunk_bytes,
            "expert_types": dict(self.expert_types), "notes": list(self.notes),
        }


def _kv_elements(g: Geometry, positions: int) -> int:
    total = 0
    for i in range(g.n_layer):
        per = g.mla_latent if g.mla_latent else g.kv_heads[i] * (g.key_length + g.value_length)
        swa = bool(g.swa) and g.swa[i] and g.sliding_window > 0
        total += per * (min(positions, g.sliding_window) if swa else positions)
    return total


def kv_bytes_per_token(g: Geometry, kv_type: str = "f16") -> int:
    """KV-cache bytes one position adds in every full-attention layer (SWA layers stop at their
    window)."""
    return kv_cache_bytes(g, 1, kv_type)


def kv_cache_bytes(g: Geometry, ctx: int, kv_type: str = "f16") -> int:
    """Bytes of the KV cache holding ``ctx`` positions in every decoder layer."""
    if kv_type not in KV_TYPES:
        raise UsageError(f"KV cache type {kv_type!r} is not known", fix=f"use one of {', '.join(KV_TYPES)}")
    if ctx < 0:
        raise UsageError(f"context length {ctx} < 0", fix="give --ctx 1 or more")
    return math.ceil(_kv_elements(g, ctx) * KV_TYPES[kv_type])


def os_headroom(ram: int) -> int:
    return max(OS_HEADROOM_MIN, int(ram * OS_HEADROOM_FRACTION))


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
    kv_type: str = "f16"
    headroom: int | None = None    # OS headroom override
    pinned_cap: float = PINNED_CAP
    label: str = ""                # "this machine", "--ram 32G --vram 24G"

    def __post_init__(self) -> None:
        if self.ram <= 0:
            raise UsageError(f"RAM {self.ram} bytes", fix="give --ram a size such as 32G")
        if self.vram < 0:
            raise UsageError(f"VRAM {self.vram} bytes", fix="give --vram a size such as 24G, or 0")
        if self.ctx < 1:
            raise UsageError(f"context length {self.ctx}", fix="give --ctx 1 or more")
        if self.kv_type not in KV_TYPES:
            raise UsageError(f"KV cache type {self.kv_type!r} is not known",
                             fix=f"use one of {', '.join(KV_TYPES)}")
        if self.headroom is not None and not 0 <= self.headroom < self.ram:
            raise UsageError(f"headroom {self.headroom} bytes of {self.ram} of RAM",
                             fix="give --headroom below --ram")
        if not 0.0 < self.pinned_cap <= 1.0:
            raise UsageError(f"pinned cap {self.pinned_cap}", fix="give --pinned-cap in (0, 1]")


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
    gpu: bool                          # a GPU takes part
    trunk: str                         # "gpu" | "cpu": where the trunk and KV cache live and run
    experts: str                       # "gpu" | "cpu": where routed experts are computed
    pinned: bool                       # the RAM tier is pinned memory

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    runnable: bool
    notes: tuple[Note, ...] = ()
    capped_bytes: int = 0              # RAM the pinned cap kept out of the tier

    @property
    def tier_slots(self) -> tuple[int, int]:
        """(VRAM slots, RAM slots) for the simulator."""
        return (self.vram.tier_slots if self.vram is not None else 0, self.ram.tier_slots)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _slots(avail: int, slot: int, k: int) -> int:
    n = max(0, avail) // slot
    return n if n >= k else 0


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


def plan_memory(g: Geometry, box: Box) -> Memory:
    """Place the trunk, the KV cache and the two expert tiers in ``box``'s RAM and VRAM."""
    notes: list[Note] = []
    slot, k = g.slot_bytes, g.k
    kv = kv_cache_bytes(g, box.ctx, box.kv_type)
    ws_cpu = workspace_bytes(g, box.ctx, "cpu")
    ws_gpu = workspace_bytes(g, box.ctx, "gpu")
    staging = STAGING_LAYERS * k * slot
    kv_note = (f"{box.ctx} positions x {kv_bytes_per_token(g, box.kv_type) / 1024:.0f} KiB "
               f"({box.kv_type}{', MLA latent' if g.mla_latent else ''})")

    gpu = box.vram > 0
    vram_items: list[Item] = []
    trunk_dev = "cpu"
    if gpu:
        reserve = max(VRAM_RESERVE_MIN, int(box.vram * VRAM_RESERVE_FRACTION))
        base = [Item("reserve", reserve, "CUDA context, allocator slack, display"),
                Item("workspace", ws_gpu, "activations, logits, dequant chunk"),
                Item("staging", staging, f"{STAGING_LAYERS} layers x {k} experts being uploaded")]
        fixed_dev = sum(i.nbytes for i in base)
        if fixed_dev + k * slot > box.vram:
            notes.append(Note("warning", "vram_too_small",
                              f"--vram {_gib(box.vram)} cannot hold the reserve, workspace and one "
                              f"layer's {k} experts ({_gib(fixed_dev + k * slot)}): the GPU is left "
                              "out and everything runs on the CPU"))
            gpu = False
        else:
            vram_items = base
            if g.trunk_bytes + kv + fixed_dev <= box.vram:
                trunk_dev = "gpu"
                vram_items = [base[0], Item("trunk", g.trunk_bytes, "attention, shared experts, "
                                            "dense FFNs, embeddings, output head"),
                              Item("kv_cache", kv, kv_note), *base[1:]]
            elif g.trunk_bytes + fixed_dev <= box.vram:
                ctx_max = max_ctx_on_gpu(g, box.vram - fixed_dev - g.trunk_bytes, box.kv_type)
                notes.append(Note("warning", "kv_not_in_vram",
                                  f"the trunk ({_gib(g.trunk_bytes)}) fits in VRAM but not with the "
                                  f"KV cache at --ctx {box.ctx} ({_gib(kv)}): both stay in RAM and "
                                  f"the trunk runs on the CPU; with --ctx {ctx_max} or less they "
                                  "would fit on the GPU" if ctx_max else
                                  f"the trunk ({_gib(g.trunk_bytes)}) leaves no VRAM for a KV cache"))
            else:
                notes.append(Note("warning", "trunk_not_in_vram",
                                  f"the trunk alone needs {_gib(g.trunk_bytes)} of {_gib(box.vram)} "
                                  f"VRAM ({_gib(box.vram - fixed_dev)} after the reserve, workspace "
                                  "and staging): it stays in RAM and runs on the CPU, and --vram "
                                  f"holds experts only; a GPU with "
                                  f"{_gib(g.trunk_bytes + kv + fixed_dev + k * slot)} or more "
                                  "would hold the trunk and KV cache too"))
    experts_dev = "gpu" if gpu else "cpu"
    pinned = gpu
    placement = Placement(gpu, trunk_dev, experts_dev, pinned)

    headroom = box.headroom if box.headroom is not None else os_headroom(box.ram)
    h_note = "--headroom" if box.headroom is not None else (
        f"max({OS_HEADROOM_MIN // GiB} GiB, {OS_HEADROOM_FRACTION:g} x RAM)")
    ram_items = [Item("os_headroom", headroom, h_note),
                 Item("runtime", RUNTIME_HOST + (RUNTIME_HOST_CUDA if gpu else 0),
                      "python, torch" + (", CUDA host side" if gpu else ""))]
    if trunk_dev == "cpu":
        ram_items += [Item("trunk", g.trunk_bytes, "computed on the CPU"), Item("kv_cache", kv, kv_note)]
    if trunk_dev == "cpu" or experts_dev == "cpu":
        ram_items.append(Item("workspace", ws_cpu, "CPU activations, logits, dequant chunk"))
    ram_items.append(Item("staging", staging, f"{STAGING_LAYERS} layers x {k} expert reads in flight"
                          + (" (pinned)" if pinned else "")))
    fixed_host = sum(i.nbytes for i in ram_items)
    runnable = fixed_host <= box.ram
    if not runnable:
        need = fixed_host + k * slot
        fix = f"a box with {_gib(need)} of RAM or more"
        if trunk_dev == "cpu" and g.trunk_bytes > GiB:
            fix += (f", or a GPU with {_gib(g.trunk_bytes + kv + 2 * GiB + staging)} or more of VRAM "
                    "to hold the trunk")
        if kv > GiB:
            fix += f", or a shorter --ctx (the KV cache is {_gib(kv)})"
        notes.append(Note("error", "ram_too_small",
                          f"RAM {_gib(box.ram)} cannot hold the fixed uses ({_gib(fixed_host)}: "
                          + ", ".join(f"{i.name} {_gib(i.nbytes)}" for i in ram_items)
                          + f"): it cannot run; it needs {fix}"))

    vram_pool = None
    vslots = 0
    if gpu:
        avail_dev = box.vram - sum(i.nbytes for i in vram_items)
        vslots = min(_slots(avail_dev, slot, k), g.n_decode_experts)
        note = ("" if vslots else "below one layer's experts: no VRAM tier")
        if vslots == g.n_decode_experts:
            note = "every expert fits in VRAM"
        vram_pool = Pool("vram", box.vram, tuple(vram_items), vslots * slot, vslots, note)

    avail = box.ram - fixed_host
    cap_note = ""
    capped = 0
    if pinned:
        cap = int(box.ram * box.pinned_cap)
        if avail > cap:
            cap_note = (f"pinned cap {box.pinned_cap:.0%} of RAM leaves {_gib(avail - cap)} unused "
                        "(pinned pages cannot be reclaimed)")
            capped = avail - cap
            avail = cap
    ram_slots = _slots(avail, slot, k) if runnable else 0
    left = g.n_decode_experts - vslots                  # exclusive tiers: no expert twice
    if ram_slots > left:
        ram_slots = max(left, k) if left > 0 else 0
        cap_note = "every expert fits in the tiers: no reads from NVMe once they are warm"
        capped = 0
    if runnable and 0 < avail // slot < k:
        notes.append(Note("warning", "ram_tier_below_layer",
                          f"the RAM left for experts ({_gib(avail)}) is below one layer's {k} "
                          f"experts ({_gib(k * slot)}): no RAM tier"
                          + (", every expert is read from NVMe each time it is used"
                             if not gpu else "")))
    ram_pool = Pool("ram", box.ram, tuple(ram_items), ram_slots * slot, ram_slots, cap_note)

    tiers = ram_pool.tier_bytes + (vram_pool.tier_bytes if vram_pool else 0)
    if runnable and tiers < g.token_expert_bytes:
        notes.append(Note("warning", "tiers_below_token",
                          f"the expert tiers ({_gib(tiers)}) hold less than one token's experts "
                          f"({_gib(g.token_expert_bytes)} = {g.k} x {len(g.moe_layers)} layers x "
                          f"{g.slot_bytes / MiB:.1f} MiB): expect disk-bound decode"))
    if box.ctx > g.n_ctx_train > 0:
        notes.append(Note("warning", "ctx_beyond_training",
                          f"--ctx {box.ctx} is beyond the model's training context {g.n_ctx_train}"))
    if runnable and ram_pool.tier_slots + vslots >= g.n_decode_experts:
        notes.append(Note("info", "all_experts_fit",
                          f"every expert ({_gib(g.decode_expert_bytes)}) fits in the tiers: after "
                          "warm-up nothing is read from NVMe"))
    return Memory(placement, ram_pool, vram_pool, kv, runnable, tuple(notes), capped)


# ------------------------------------------------------------------------------------------------
# rates


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

    def cost(self, ggml_type: str) -> LinearCost:
        c = self.linear.get(ggml_type) or self.linear.get("*")
        if c is None:
            raise UsageError(f"no {self.device} rate for {ggml_type}", fix="probe or give a default")
        return c

    def as_dict(self) -> dict[str, Any]:
        return {"linear": {t: c.as_dict() for t, c in self.linear.items()},
                "mem_gbps": self.mem_gbps.as_dict(), "op_s": self.op_s.as_dict(),
                "sync_s": self.sync_s.as_dict()}


@dataclass(frozen=True)
class Rates:
    storage: Range                     # GB/s of whole-extent random reads
    pcie: Range                        # GB/s host -> device (pinned)
    cpu: DeviceRates
    gpu: DeviceRates

    def as_dict(self) -> dict[str, Any]:
        return {"storage_gbps": self.storage.as_dict(), "pcie_gbps": self.pcie.as_dict(),
                "cpu": self.cpu.as_dict(), "gpu": self.gpu.as_dict()}


#: pinned host->device GB/s by PCIe generation (x16): what cudaMemcpy reaches, not the line rate
PCIE_GENS: dict[int, tuple[float, float]] = {3: (10.0, 12.5), 4: (20.0, 25.0), 5: (40.0, 50.0)}


def stated_storage() -> Range:
    return Range(2.0, 4.0, "stated default: a PCIe 4.0 NVMe at expert-sized random reads (peers "
                           "measured 3-6 GB/s O_DIRECT on Gen4, 1-2.7 on VM/WSL disks); measure it: "
                           "expertfs bench io STORE --json > io.json, then --io-profile io.json")


def stated_pcie(gen: int = 4) -> Range:
    if gen not in PCIE_GENS:
        raise UsageError(f"PCIe generation {gen} is not known", fix="give --pcie 3, 4 or 5")
    lo, hi = PCIE_GENS[gen]
    return Range(lo, hi, f"stated default: PCIe {gen}.0 x16 pinned host->device copies")


_FLOAT_TYPES = ("F32", "F16", "BF16")


def stated_cpu() -> DeviceRates:
    src = ("stated default: torch dequant+matmul at batch 1 on 2 AVX2 cores "
           "(formats.dequant.linear; measure with a store or GGUF, or drop --no-probe)")
    quant = LinearCost(Range(200e-6, 60e-6, src), Range(0.3, 0.8, src))
    plain = LinearCost(Range(50e-6, 10e-6, src), Range(5.0, 15.0, src))
    linear = {"*": quant, **{t: plain for t in _FLOAT_TYPES}}
    return DeviceRates("cpu", linear, Range(10.0, 20.0, "stated default: DDR4/DDR5 dual channel, one "
                                                        "process"),
                       Range(5e-6, 2e-6, "stated default: torch eager CPU op"), Range(0.0, 0.0, "none"))


def _bytes_per_element(ggml_type: str) -> float:
    from ..formats.ggml import GGMLType, block_size, type_size
    try:
        t = GGMLType[ggml_type]
        return type_size(t) / block_size(t)
    except (KeyError, ValueError, ZeroDivisionError):
        return 0.5625


def stated_gpu(types: Sequence[str], mem: Range | None = None) -> DeviceRates:
    """GPU costs from memory bandwidth: a dequant-then-matmul moves the quantized bytes plus
    ``GPU_TRAFFIC_PER_ELEMENT`` bytes per weight (float dequant written and read back), and
    every call pays launch overhead for its ~10-20 kernels."""
    mem = mem or Range(500.0, 900.0, "stated default: a 24 GB consumer GPU (RTX 3090/4090 class, "
                                     "~0.94-1.0 TB/s peak)")
    over = Range(120e-6, 40e-6, "stated default: torch eager dequant kernels, 10-20 launches per call")

    def cost(t: str) -> LinearCost:
        bpe = _bytes_per_element(t)
        eff = 1.0 if t in _FLOAT_TYPES else bpe / (bpe + GPU_TRAFFIC_PER_ELEMENT)
        return LinearCost(over, Range(mem.slow * eff, mem.fast * eff,
                                      f"{mem.source}; x {eff:.3f} for dequant traffic"))

    linear = {t: cost(t) for t in types if t != "*"}
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
    detail = {"backend": chosen, "slow_qd": slow_qd, "fast_qd": fast_qd,
              "read_size": read, "p99_latency_us_at_slow_qd": (slow_p.get("lat_us") or {}).get("p99"),
              "cold": profile.get("cold")}
    return Range(slow, fast, src), detail


# ------------------------------------------------------------------------------------------------
# routing (from the simulator) and the prediction


@dataclass(frozen=True)
class Routing:
    """Cache behaviour at the planned tiers, per token, from replaying a trace."""

    label: str
    synthetic: bool
    policy: str
    tokens: int
    vram_hit_rate: float
    ram_hit_rate: float
    miss_rate: float
    nvme_bytes_per_token: float
    h2d_bytes_per_token: float
    d2h_bytes_per_token: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RoutingRange:
    slow: Routing
    fast: Routing

    def at(self, end: str) -> Routing:
        return self.slow if end == "slow" else self.fast


@dataclass(frozen=True)
class Term:
    name: str
    slow_s: float
    fast_s: float
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    terms: tuple[Term, ...]
    slow_s: float                      # seconds per token at the slow end (all terms summed)
    fast_s: float                      # at the fast end (overlapped)
    dominant_slow: str
    dominant_fast: str

    @property
    def tok_s_low(self) -> float:
        return 1.0 / self.slow_s if self.slow_s > 0 else math.inf

    @property
    def tok_s_high(self) -> float:
        return 1.0 / self.fast_s if self.fast_s > 0 else math.inf

    def term(self, name: str) -> Term | None:
        return next((t for t in self.terms if t.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        total_slow = self.slow_s or 1.0
        return {"tok_s_low": self.tok_s_low, "tok_s_high": self.tok_s_high,
                "s_per_token_slow": self.slow_s, "s_per_token_fast": self.fast_s,
                "dominant_slow": self.dominant_slow, "dominant_fast": self.dominant_fast,
                "terms": {t.name: {**t.as_dict(), "share_slow": t.slow_s / total_slow}
                          for t in self.terms},
                "combine": "slow = sum of the terms at pessimistic rates; fast = max(storage, "
                           "pcie, compute) at optimistic rates, compute = experts + trunk + "
                           "attention + dispatch"}


_IO_TERMS = ("storage", "pcie")


def _compute_cost(rates: DeviceRates, mats: Sequence[Matrix], end: str, times: int = 1) -> float:
    return times * sum(rates.cost(m.ggml_type).seconds(m.nbytes, end, m.count) for m in mats)


def predict(g: Geometry, mem: Memory, routing: RoutingRange, rates: Rates, box: Box) -> Prediction:
    """Seconds per token, term by term, at the slow and the fast end (see the module docstring)."""
    pl = mem.placement
    trunk_rates = rates.gpu if pl.trunk == "gpu" else rates.cpu
    exp_rates = rates.gpu if pl.experts == "gpu" else rates.cpu
    terms: list[Term] = []

    def both(fn) -> tuple[float, float]:
        return fn("slow"), fn("fast")

    s = both(lambda e: routing.at(e).nvme_bytes_per_token / (rates.storage.at(e) * 1e9))
    r = routing.slow
    terms.append(Term("storage", *s,
                      f"{r.nvme_bytes_per_token / MiB:.0f} MiB/token read (miss {r.miss_rate:.1%} of "
                      f"{g.token_expert_bytes / MiB:.0f} MiB) at {rates.storage.slow:.2f}-"
                      f"{rates.storage.fast:.2f} GB/s"))
    if pl.experts == "gpu":
        p = both(lambda e: max(routing.at(e).h2d_bytes_per_token, routing.at(e).d2h_bytes_per_token)
                 / (rates.pcie.at(e) * 1e9))
        terms.append(Term("pcie", *p,
                          f"{r.h2d_bytes_per_token / MiB:.0f} MiB/token up, "
                          f"{r.d2h_bytes_per_token / MiB:.0f} MiB demoted (full duplex: the larger "
                          f"counts) at {rates.pcie.slow:.0f}-{rates.pcie.fast:.0f} GB/s"))
    ex = both(lambda e: g.k * sum(_compute_cost(exp_rates, parts, e) for parts in g.expert_parts))
    terms.append(Term("experts", *ex,
                      f"{g.k} x {len(g.moe_layers)} experts ({g.token_expert_bytes / MiB:.0f} MiB "
                      f"incl. padding) dequant+matmul on the {pl.experts.upper()}"))
    tr = both(lambda e: _compute_cost(trunk_rates, g.trunk_matrices, e))
    terms.append(Term("trunk", *tr, f"{g.trunk_active_bytes / MiB:.0f} MiB of trunk matrices on "
                                    f"the {pl.trunk.upper()}"))
    kv_slow = kv_cache_bytes(g, box.ctx, box.kv_type)
    kv_fast = kv_cache_bytes(g, max(1, int(box.ctx * ATTENTION_FAST_FRACTION)), box.kv_type)
    at = (kv_slow / (trunk_rates.mem_gbps.slow * 1e9), kv_fast / (trunk_rates.mem_gbps.fast * 1e9))
    terms.append(Term("attention", *at, f"KV cache {kv_slow / MiB:.0f} MiB at ctx {box.ctx} "
                                        f"({kv_fast / MiB:.0f} MiB at the fast end) read at "
                                        f"{trunk_rates.mem_gbps.slow:.0f}-"
                                        f"{trunk_rates.mem_gbps.fast:.0f} GB/s"))
    syncs = (1 if pl.experts == "gpu" else 0) + (2 if pl.experts != pl.trunk else 0)
    dp = both(lambda e: g.n_layer * (OPS_PER_LAYER * trunk_rates.op_s.at(e)
                                     + syncs * rates.gpu.sync_s.at(e)))
    terms.append(Term("dispatch", *dp, f"{g.n_layer} layers x ({OPS_PER_LAYER} small ops"
                                       + (f" + {syncs} device syncs" if syncs else "") + ")"))
    slow = sum(t.slow_s for t in terms)
    compute_fast = sum(t.fast_s for t in terms if t.name not in _IO_TERMS)
    fast = max([compute_fast] + [t.fast_s for t in terms if t.name in _IO_TERMS])
    dom_slow = max(terms, key=lambda t: t.slow_s).name
    io_fast = max((t for t in terms if t.name in _IO_TERMS), key=lambda t: t.fast_s)
    dom_fast = io_fast.name if io_fast.fast_s >= compute_fast else "compute"
    return Prediction(tuple(terms), slow, fast, dom_slow, dom_fast)


# ------------------------------------------------------------------------------------------------
# advice and the whole plan


def advise(g: Geometry, mem: Memory, pred: Prediction | None, routing: RoutingRange | None,
           rates: Rates | None, box: Box) -> list[Note]:
    """Plain words about what limits decode and what to change."""
    out: list[Note] = []
    if pred is None:
        return out
    dom = pred.dominant_slow
    t = pred.term(dom)
    share = t.slow_s / pred.slow_s if t and pred.slow_s else 0.0
    tiers = mem.ram.tier_bytes + (mem.vram.tier_bytes if mem.vram else 0)
    if dom == "storage":
        more = ""
        if tiers < g.decode_expert_bytes:
            more = (f"; the tiers hold {tiers / max(1, g.decode_expert_bytes):.0%} of the experts "
                    f"({_gib(tiers)} of {_gib(g.decode_expert_bytes)}): more RAM or VRAM raises the "
                    "hit rate")
        out.append(Note("info", "storage_bound",
                        f"decode is storage-bound ({share:.0%} of the slow-end time): a faster "
                        f"drive or backend lifts it in proportion{more}"))
    elif dom == "experts" and mem.placement.experts == "cpu":
        out.append(Note("info", "cpu_bound",
                        f"decode is bound by dequant+matmul on the CPU ({share:.0%}): a GPU (--vram) "
                        "computes experts far faster; more cores help in proportion"))
    elif dom in ("experts", "trunk", "dispatch"):
        out.append(Note("info", "compute_bound",
                        f"decode is compute-bound ({dom}, {share:.0%} of the slow-end time) on the "
                        f"{(mem.placement.experts if dom == 'experts' else mem.placement.trunk).upper()}"
                        ": more cache would not help much"))
    elif dom == "pcie":
        out.append(Note("info", "pcie_bound",
                        f"decode is bound by host->device copies ({share:.0%}): a larger VRAM tier "
                        "or a faster PCIe link helps"))
    elif dom == "attention":
        out.append(Note("info", "attention_bound",
                        f"reading the KV cache dominates ({share:.0%}) at --ctx {box.ctx}: a "
                        "shorter context or a quantized KV cache (--kv-type q8_0) helps"))
    if mem.capped_bytes and dom == "storage":
        out.append(Note("info", "pinned_cap",
                        f"the pinned cap ({box.pinned_cap:.0%} of RAM) keeps {_gib(mem.capped_bytes)} "
                        "out of the RAM tier; raise --pinned-cap only on a box that runs nothing else"))
    if routing is not None and routing.slow.synthetic:
        out.append(Note("info", "routing_synthetic",
                        "hit rates come from synthetic routing ("
                        + (routing.slow.label if routing.slow.label == routing.fast.label else
                           f"slow end {routing.slow.label}, fast end {routing.fast.label}")
                        + "), not from this model: record a trace of a real run and pass --trace"))
    if rates is not None and rates.storage.source.startswith("stated"):
        out.append(Note("info", "storage_default",
                        "storage was not measured (stated default used): run `expertfs bench io "
                        "STORE --json > io.json` on the drive that holds the store and pass "
                        "--io-profile io.json"))
    return out


@dataclass(frozen=True)
class Plan:
    geometry: Geometry
    box: Box
    memory: Memory
    rates: Rates | None
    routing: RoutingRange | None
    prediction: Prediction | None
    notes: tuple[Note, ...]
    probes: Mapping[str, Any] = field(default_factory=dict)     # raw measurements, for --json

    @property
    def exit_code(self) -> int:
        return 0 if self.memory.runnable else 1


def make_plan(g: Geometry, box: Box, mem: Memory, rates: Rates | None,
              routing: RoutingRange | None, probes: Mapping[str, Any] | None = None) -> Plan:
    """Put the pieces together: the prediction only for a box that can run the model."""
    pred = predict(g, mem, routing, rates, box) if (mem.runnable and rates and routing) else None
    notes = list(mem.notes) + advise(g, mem, pred, routing, rates, box)
    return Plan(g, box, mem, rates, routing, pred, tuple(notes), dict(probes or {}))


def plan_to_dict(p: Plan) -> dict[str, Any]:
    m = p.memory
    return {
        "schema": SCHEMA,
        "status": "fits" if m.runnable else "cannot_run",
        "exit_code": p.exit_code,
        "model": p.geometry.as_dict(),
        "box": {"ram_bytes": p.box.ram, "vram_bytes": p.box.vram, "ctx": p.box.ctx,
                "kv_type": p.box.kv_type, "label": p.box.label, "pinned_cap": p.box.pinned_cap},
        "placement": m.placement.as_dict(),
        "budget": {"ram": m.ram.as_dict(), "vram": m.vram.as_dict() if m.vram else None,
                   "kv_cache_bytes": m.kv_bytes,
                   "kv_bytes_per_token": kv_bytes_per_token(p.geometry, p.box.kv_type),
                   "slot_bytes": p.geometry.slot_bytes,
                   "tier_experts": m.ram.tier_slots + (m.vram.tier_slots if m.vram else 0),
                   "decode_experts": p.geometry.n_decode_experts},
        "rates": p.rates.as_dict() if p.rates else None,
        "routing": ({"slow": p.routing.slow.as_dict(), "fast": p.routing.fast.as_dict()}
                    if p.routing else None),
        "prediction": p.prediction.as_dict() if p.prediction else None,
        "notes": [n.as_dict() for n in p.notes],
        "assumptions": dict(ASSUMPTIONS),
        "measurements": dict(p.probes),
    }
