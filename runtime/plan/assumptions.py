"""What ``expertfs plan`` models, and every constant it assumes (reported in ``--json``).

**Placements** are what ``expertfs run`` executes: ``gpu`` (trunk, KV cache and experts
computed on the GPU; a VRAM tier above a RAM tier) or ``cpu`` (everything on the CPU, one RAM
tier); ``hybrid`` (trunk and KV cache on the CPU, experts on the GPU) is planned too but only
reported as an alternative, since the runtime runs trunk and experts on one device. The trunk
is either ``float`` (dequantized at load into the compute dtype: bfloat16 on CUDA, float32 on
CPU — the runtime's default) or ``quant`` (ggml bytes, dequantized on every call).
``plan.budget`` budgets the memory of each (placement, trunk mode); ``plan.predict`` predicts
its decode speed and keeps the fastest one the runtime supports.

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
  device synchronisations;
- ``read_cpu``: the CPU the storage term's reads take from the cores that compute (system
  calls, completions, wake-ups: the storage probe's reads into memory in use) and, at the slow
  end, the checksums of an expert's first read in a process;
- ``overlap`` (negative): a layer's resident experts, and its missing ones as they land,
  computed while its other misses are read (``plan.overlap``);
- ``first_reads`` and ``warm_start``: a run's start (``plan.coldstart``), the experts its decode
  reads once after the prompt's and the CPU of the warm start filling the RAM tier behind it.

slow s/token = the sum of every term at pessimistic rates, less the overlap a layer's reads have
with its own experts (``plan.overlap``); fast s/token = the same at optimistic rates, or where
the lookahead reads the next layer's experts by default (glm5-next) the largest of storage, pcie
and compute (everything else summed). tokens/s low–high = 1/slow – 1/fast. The dominant term
is the largest one at each end. The prompt's prefill is ``plan.prefill``'s first token; MTP
drafts are not modelled.
Each rate is a ``plan.rates.Range``: the value used for the slow end and the one used for the
fast end, so a bandwidth has ``slow < fast`` and a per-call overhead ``slow > fast``.
"""

from __future__ import annotations

from typing import Any

from .. import memory as _memory

__all__ = ["SCHEMA", "GiB", "MiB", "OS_HEADROOM_MIN", "OS_HEADROOM_FRACTION", "RUNTIME_HOST",
           "RUNTIME_HOST_CUDA", "VRAM_RESERVE_MIN", "VRAM_RESERVE_FRACTION", "PIN_BUDGET_FRACTION",
           "PAGEABLE_FACTOR", "QUEUE_DEPTH", "CPU_DEQUANT_CHUNK", "GPU_DEQUANT_CHUNK",
           "DEQUANT_BYTES_PER_ELEMENT", "GPU_TRAFFIC_PER_ELEMENT", "OPS_PER_LAYER",
           "EXPERT_OVERHEAD_S", "ATTENTION_FAST_FRACTION", "PLACEMENTS", "TRUNK_MODES",
           "TRUNK_REREAD", "PAGE_REREAD", "ASSUMPTIONS"]

SCHEMA = "expertfs.store.plan/1"
GiB = 1 << 30
MiB = 1 << 20

# the host side is ``runtime.memory``'s, the model ``expertfs run`` sizes its RAM tier with
OS_HEADROOM_MIN = _memory.OS_HEADROOM_MIN          # left to the OS on an uncapped box ...
OS_HEADROOM_FRACTION = _memory.OS_HEADROOM_FRACTION  # ... or an eighth of RAM; none under a cap
RUNTIME_HOST = _memory.RUNTIME_OVERHEAD            # python, torch, kernels, staging, allocator
RUNTIME_HOST_CUDA = _memory.RUNTIME_OVERHEAD_CUDA  # plus the CUDA libraries' host side on a GPU run
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
#: silu*mul, weighted sum, compiled-kernel guards), seconds at the (slow, fast) end: a stated
#: cost, calibrated against ``expertfs run`` on the demo store (its source in ``ASSUMPTIONS``)
EXPERT_OVERHEAD_S = (600e-6, 200e-6)
ATTENTION_FAST_FRACTION = 0.25     # fast end reads the KV cache at this share of ctx
PLACEMENTS = ("gpu", "hybrid", "cpu")
TRUNK_MODES = ("float", "quant")
#: a quantized trunk the cap keeps E bytes out of memory is re-read this many times E a token
#: (fast, slow end), at most whole: about what is out, or a few times that where each page
#: faulted back in evicts one the same token reads again, not all of it for a small E as an
#: LRU's worst case would; bounds of capped runs on three cuts (bench/README.md, "`plan`'s
#: trunk re-reads under a cap")
TRUNK_REREAD = (1.0, 4.0)
#: ... and the runtime's library pages a cap below the working set keeps out, this many times
#: a token (fast, slow end): a page of code or of a kernel's table is faulted back in by every
#: call that needs it, several a layer, evicting another the next call needs
#: (``runtime.memory.runtime_resident``; bench/README.md, "`plan` below the working set")
PAGE_REREAD = (1.0, 16.0)

ASSUMPTIONS: dict[str, Any] = {
    "os_headroom": f"max({OS_HEADROOM_FRACTION:g} x RAM, min({OS_HEADROOM_MIN // GiB} GiB, RAM / 4)) "
                   "on an uncapped box, none under a cap (cgroup, EXPERTFS_MEMORY_LIMIT, "
                   "--memory-limit), unless --headroom",
    "host_budget": "runtime.memory.host_budget, the function expertfs run sizes its default "
                   "RAM tier with: limit - headroom - runtime - trunk - KV reserve - workspace",
    "kv_growth_peak": _memory.KV_GROWTH_PEAK,
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
                          "source": "calibrated once: expert run on the demo store, 2-core VM; "
                                    "the torch path's, where the native kernels are unavailable"},
    "trunk_reread": f"{TRUNK_REREAD[0]:g}-{TRUNK_REREAD[1]:g} x the trunk bytes the cap keeps "
                    "out of memory, a token (at most the whole trunk)",
    "page_reread": f"{PAGE_REREAD[0]:g}-{PAGE_REREAD[1]:g} x the runtime's library pages a cap "
                   "below the working set keeps out of memory, a token",
    "tiers": "exclusive (an expert is in VRAM or in RAM), slots of the largest extent",
    "kv_cache": "decoder layers only (not NextN); MLA caches the latent (kv_lora_rank + rope dims); "
                f"sliding-window layers hold a ring of min(ctx, {_memory.SWA_RING_WINDOWS} windows) "
                f"positions and {_memory.SWA_CHECKPOINTS} copies of it when ctx is longer; "
                "auto type = compute dtype",
    "choice": "the placement and trunk mode with the highest predicted sqrt(low x high) tok/s "
              "among those expert run supports",
    "not_modelled": "prefill on a GPU, MTP/draft verification, NUMA, thermal throttling",
}

#: How ``plan.predict`` combines its terms into the slow and the fast end of a token.
COMBINE = ("slow = sum of the terms at pessimistic rates, the overlap term negative (resident "
           "experts, then missing ones as they land, computed while a layer's other misses are "
           "read, as the CPU decode does); fast = the same at optimistic rates, or where the "
           "lookahead reads ahead by default max(storage + first_reads + trunk_reads, pcie, "
           "compute), compute = experts + trunk + attention + dispatch + read_cpu (the misses' "
           "reads) + warm_start (the CPU of the warm start's background reads)")
