"""The host side of a run's memory, shared by ``expertfs run`` and ``expertfs plan``: the
trunk a run keeps resident, the CPU workspace, and ``run_host_budget`` (the model's
``runtime.memory.host_budget``, which sizes ``run``'s default ``--ram`` and ``plan``'s RAM
pool). Pure: plain values in, bytes out."""

from __future__ import annotations

from dataclasses import replace as _replace

from .. import memory as _memory
from ..cache.sizing import window_slots
from ..memory import HostBudget
from .assumptions import CPU_DEQUANT_CHUNK, DEQUANT_BYTES_PER_ELEMENT, GPU_DEQUANT_CHUNK, QUEUE_DEPTH
from .geometry import DTYPE_BYTES, Geometry, kv_cache_bytes

__all__ = ["LIMIT_SOURCES", "os_headroom", "workspace_bytes", "prefill_activation_bytes",
           "budget_batch", "trunk_host_bytes", "run_host_budget", "cap_evicts", "cap_fit",
           "PREFILL_BATCH"]

LIMIT_SOURCES = ("physical", "cgroup", "env", "limit")
#: ``expertfs run --batch``'s default: the prompt tokens one forward pass takes
PREFILL_BATCH = 256
#: the dense MLA attention forms its scores for at most this many (query, head, position) at
#: once (``runtime.model.mla.MQA_CHUNK``), and absorbs at most this many (query, head, latent)
#: elements at once (``runtime.model.mla.MLA_QUERY_CHUNK``)
MQA_SCORES = 1 << 23
MLA_QUERIES = 1 << 22


def os_headroom(ram: int, source: str = "physical") -> int:
    """RAM left to the OS: an eighth of RAM, at least 3 GiB (a quarter on boxes under 12 GiB);
    none under a cap (``runtime.memory.os_headroom``)."""
    return _memory.os_headroom(ram, source)


def workspace_bytes(g: Geometry, ctx: int, device: str, batch: int = 1) -> int:
    """Activations and temporaries on ``device`` ("cpu" or "gpu"): a dequant chunk, the logits,
    attention scores at ``ctx``, hidden states of one decode step, and with ``batch`` > 1 a
    prompt batch's activations (``prefill_activation_bytes``)."""
    chunk = CPU_DEQUANT_CHUNK if device == "cpu" else GPU_DEQUANT_CHUNK
    dequant = min(g.largest_matrix_elements, chunk) * DEQUANT_BYTES_PER_ELEMENT
    logits = g.n_vocab * 4
    scores = 2 * g.n_head * ctx * 4
    hidden = 16 * max(g.n_embd, max((m.rows for layer in g.expert_parts for m in layer), default=0)) * 4
    return dequant + logits + scores + hidden + prefill_activation_bytes(g, ctx, batch)


def budget_batch(prompt_tokens: int, batch: int = PREFILL_BATCH) -> int:
    """The prompt batch a run's memory holds: ``--batch``, or the prompt where it is shorter
    (``prompt_tokens`` 0: not known, the whole batch). ``run`` budgets its own prompt so,
    ``plan`` its ``--prompt-tokens``."""
    return min(batch, prompt_tokens) if prompt_tokens > 0 else batch


def prefill_activation_bytes(g: Geometry, ctx: int, batch: int) -> int:
    """Float32 activations a prompt batch of ``batch`` tokens (at most ``ctx``) holds at once on
    the CPU, beyond one decode step's: per token, every head's query and output rows (MLA: the
    query, the output latent and the value rows, two latents' width together, and the
    absorbed queries a chunk of ``MLA_QUERIES`` at a time), the scores and probabilities of a
    first prompt (MLA's in chunks of ``MQA_SCORES``), the widest trunk product's outputs
    (gate, up, their product) and the hidden states (mHC: each of its ``hc_streams``)."""
    t = max(0, min(batch, ctx))
    if t <= 1:
        return 0
    h = g.n_head
    if g.mla_latent:
        per_head = 2 * g.mla_latent
        scores = 2 * MLA_QUERIES + 2 * min(MQA_SCORES, t * h * t)
    else:
        per_head = 2 * (g.key_length + g.value_length)
        scores = 2 * t * h * t
    widest = max([m.rows for m in g.trunk_matrices if m.rows != g.n_vocab]
                 + [m.rows for layer in g.expert_parts for m in layer], default=0)
    return 4 * (t * h * per_head + scores + 3 * t * widest + 6 * t * g.n_embd * g.hc_streams)


def trunk_host_bytes(g: Geometry, mode: str, device: str = "cpu",
                     kept_types: frozenset[str] | None = None,
                     float_budget: int | None = None) -> int:
    """Trunk bytes a run keeps resident in host memory: none when the trunk is on the GPU;
    else ggml bytes, with the matrices the mode dequantizes at load in float32, and without an
    untied token embedding (read a row per token from the mapped file), the NextN blocks' only
    where the run drafts with them (``g.nextn_loaded``). ``mode`` "auto" is the
    runtime's rule (``runtime.model.weights.plan_float``): the ``kept_types`` (those with a
    fused product) stay quantized, the others are dequantized unless their float size passes
    ``float_budget``, then the largest stay quantized until the rest fits."""
    if device != "cpu":
        return 0
    untied = not any(m.tied for m in g.trunk_matrices)
    base = g.loaded_trunk_bytes - (g.embd_bytes if untied else 0)
    if mode == "quant":
        return max(0, base)
    el = DTYPE_BYTES["cpu"]
    mats = [m for m in (*g.trunk_matrices, *g.loaded_nextn_matrices) if m.ggml_type != "F32"]
    if mode == "auto":
        mats = [m for m in mats if m.ggml_type not in (kept_types or ())]
        if float_budget is not None:
            total = sum(m.count * m.elements * el for m in mats)
            mats = sorted(mats, key=lambda m: -m.elements)
            while mats and total > float_budget:                       # the largest stay quantized
                m = mats.pop(0)
                total -= m.count * m.elements * el
    extra = sum(m.count * (m.elements * el - (0 if m.tied else m.nbytes)) for m in mats)
    return max(0, base + extra)


def cap_evicts(trunk: int, pages: int, avail: int, slot: int, k: int) -> tuple[int, int] | None:
    """What a cap that leaves ``avail`` (less than ``k`` slots of ``slot``) beside a CPU run's
    needs keeps out of memory so that ``run``'s fallback tier fits: (bytes of the quantized
    trunk, of the runtime's library ``pages``), the trunk's file pages first; None where even
    both out leave no room (the process would be killed)."""
    fall = _memory.fallback_slab(slot, k)
    if avail + trunk + pages < fall:
        return None
    out = fall - avail
    return min(trunk, out), max(0, min(pages, out - trunk))


def cap_fit(g: Geometry, kv_type: str, ctx: int, used: int, hb: HostBudget, pages: int,
            avail: int, slot: int, k: int) -> tuple[tuple[int, int] | None, int | None]:
    """``cap_evicts`` for a CPU run with the budget ``hb`` (the KV cache reserved at ``ctx``),
    and the most positions that fit where the whole context does not: the KV cache grows with
    the positions a run writes (``runtime.model.attention.cache_zeros``: pages exist where
    written), so a run of ``used`` positions (the prompt and its tokens) may fit where its
    ``--ctx`` would not. ((trunk, pages) evicted or None, those positions or None)."""
    out = cap_evicts(hb.trunk, pages, avail, slot, k)
    if out is not None or not hb.kv:
        return out, None

    def evicts(n: int) -> tuple[int, int] | None:
        kv = _memory.kv_reserve(kv_cache_bytes(g, n, kv_type), g.state_bytes)
        return cap_evicts(hb.trunk, pages, avail + hb.kv - kv, slot, k)
    used = max(1, min(ctx, used))
    if (out := evicts(used)) is None:
        return None, None
    lo, hi = used, ctx                                  # lo fits, ctx does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if evicts(mid) is None else (mid, hi)
    return out, lo


def run_host_budget(g: Geometry, ctx: int, device: str = "cpu", trunk_mode: str = "quant", *,
                    experts_on_gpu: bool | None = None,
                    kv_type: str | None = None, limit: int | None = None,
                    source: str | None = None, headroom: int | None = None,
                    kept_types: frozenset[str] | None = None, vram_tier_experts: int = 0,
                    batch: int = PREFILL_BATCH) -> HostBudget:
    """The host budget ``expertfs run`` sizes its default ``--ram`` with, for ``g`` at ``ctx``
    on ``device`` ("cpu" or "gpu"): ``runtime.memory.host_budget`` with this model's trunk,
    KV cache (and fixed recurrent state), workspace (a prompt batch of ``batch`` tokens
    included: ``run --batch``) and, on a GPU run, staging slots. The
    slab is bounded by the experts the VRAM tier does not hold. ``expertfs plan`` budgets RAM
    with the same function."""
    gpu = device != "cpu"
    gpu_experts = gpu if experts_on_gpu is None else experts_on_gpu
    kt = kv_type or ("bf16" if gpu else "f32")
    kv = 0 if gpu else kv_cache_bytes(g, ctx, kt)
    if limit is None:
        limit, src = _memory.limit_and_source()
        source = source or src
    fb = limit // 4 if trunk_mode == "auto" else None      # the engine's float trunk budget
    staging = (min(QUEUE_DEPTH, g.k) + 1) * g.slot_bytes if gpu_experts else 0
    left = max(0, g.n_decode_experts - vram_tier_experts)
    if not gpu_experts and not vram_tier_experts:     # a CPU tier of every expert: its window
        left += window_slots(g.slot_bytes, g.k, g.n_experts)
    b = _memory.host_budget(trunk_host_bytes(g, trunk_mode, "gpu" if gpu else "cpu", kept_types, fb),
                            kv, state_bytes=0 if gpu else g.state_bytes,
                            workspace=0 if gpu and gpu_experts else workspace_bytes(g, ctx, "cpu", batch),
                            staging=staging, cuda=gpu or gpu_experts,
                            experts=left * g.slot_bytes, limit=limit, source=source)
    if headroom is not None:
        b = _replace(b, headroom=headroom)
    return b


