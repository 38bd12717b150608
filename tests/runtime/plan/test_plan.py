"""``expertfs.runtime.plan``: budget arithmetic, KV sizes, prediction terms, monotonicity, presets.

Everything here is arithmetic on known geometries with stated rates (no timing assertions); the
synthetic routing is kept to a few dozen tokens so the simulator runs in well under a second.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from expertfs.cli.plan import geometry_from_like, geometry_from_synth
from expertfs.errors import UsageError
from expertfs.runtime import memory
from expertfs.runtime.plan.assumptions import PAGE_REREAD, TRUNK_REREAD, GiB
from expertfs.runtime.plan.coldstart import window_spare
from expertfs.runtime.plan.budget import Box, candidates, layout, max_ctx_on_gpu, os_headroom
from expertfs.runtime.plan.geometry import Geometry, kv_bytes_per_token, kv_cache_bytes
from expertfs.runtime.plan.rereads import trunk_reread_bytes
from expertfs.runtime.plan.predict import (Option, Range, Rates, Routing, RoutingRange, choose,
                                           make_plan, plan_to_dict, predict, stated_cpu,
                                           stated_gpu, stated_pcie, stated_storage,
                                           storage_from_profile)
from expertfs.runtime.plan.routing import route, synthetic_replay, trace_replay
from expertfs.runtime.plan.run import plan_options
from expertfs.runtime.trace.synth import parse_spec, write_synthetic
from expertfs.synth import SynthConfig, preset_names

_GEOM: dict[str, Geometry] = {}


def like(name: str) -> Geometry:
    if name not in _GEOM:
        _GEOM[name] = geometry_from_like(name)
    return _GEOM[name]


def rates_for(g: Geometry) -> Rates:
    types = sorted({m.ggml_type for layer in g.expert_parts for m in layer}
                   | {m.ggml_type for m in g.trunk_matrices})
    return Rates(stated_storage(), stated_pcie(4), stated_cpu(), stated_gpu(types))


def plan_for(g: Geometry, box: Box, tokens: int = 32, replays=None, where: str = "auto",
             trunk: str = "auto"):
    """What ``expertfs plan --no-probe`` does, with a short synthetic routing."""
    replays = replays or {s: synthetic_replay(g, s, tokens=tokens) for s in ("diffuse", "mixed")}
    rates = rates_for(g)

    def routing_for(mem):
        v, r = mem.tier_slots
        ends = [route(g, replays[s], v, r, experts_on_gpu=mem.placement.experts == "gpu",
                      label=f"synthetic '{s}'", synthetic=True) for s in ("diffuse", "mixed")]
        return RoutingRange(*ends)

    opts = plan_options(g, box, rates, routing_for, where=where, trunk_mode=trunk)
    return make_plan(g, box, opts, rates, forced=where != "auto" and trunk != "auto")


# --- KV cache against hand-computed values ---------------------------------------------------------

@pytest.mark.parametrize("name, per_token", [
    # layers x kv_heads x (key + value length) x 2 bytes (f16)
    ("Qwen3-235B-A22B", 94 * 4 * (128 + 128) * 2),          # 192,512
    ("Qwen3-30B-A3B", 48 * 4 * (128 + 128) * 2),            # 98,304
    ("GLM-4.5-Air", 46 * 8 * (128 + 128) * 2),              # 188,416: 46 decoder layers, not NextN
    ("GLM-4.5", 92 * 8 * (128 + 128) * 2),                  # 376,832
    ("Mixtral-8x7B", 32 * 8 * (128 + 128) * 2),             # head_dim = 4096 / 32
    ("DeepSeek-V3", 61 * (512 + 64) * 2),                   # MLA: latent kv_lora_rank + rope dims
])
def test_kv_bytes_per_token(name: str, per_token: int) -> None:
    g = like(name)
    assert kv_bytes_per_token(g) == per_token
    assert kv_cache_bytes(g, 8192) == 8192 * per_token
    assert kv_cache_bytes(g, 8192, "f32") == 2 * 8192 * per_token
    assert kv_cache_bytes(g, 8192, "q8_0") == math.ceil(8192 * per_token / 2 * 34 / 32)


def test_kv_hand_values_8k() -> None:
    assert kv_cache_bytes(like("Qwen3-235B-A22B"), 8192) == 1_577_058_304
    assert kv_cache_bytes(like("GLM-4.5-Air"), 8192) == 1_543_503_872
    assert kv_cache_bytes(like("DeepSeek-V3"), 8192) == 575_668_224
    assert like("DeepSeek-V3").mla_latent == 576


def test_kv_sliding_window_layers() -> None:
    g = like("gpt-oss-120b")                   # 36 layers, even ones slide over 128 positions
    per_layer = 8 * (64 + 64) * 2
    assert sum(g.swa) == 18 and g.sliding_window == 128
    ring = 2 * 128                             # two windows, and two copies of it past them
    assert kv_bytes_per_token(g) == 18 * per_layer                 # the full layers grow
    assert kv_cache_bytes(g, 8192) == 18 * 8192 * per_layer + 18 * 3 * ring * per_layer
    assert kv_cache_bytes(g, 200) == 36 * 200 * per_layer       # within the ring: all layers grow


def test_kv_errors() -> None:
    with pytest.raises(UsageError, match="KV cache type"):
        kv_cache_bytes(like("GLM-4.5-Air"), 10, "q3")


# --- geometry ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", preset_names())
def test_like_every_preset_plans(name: str) -> None:
    g = like(name)
    assert g.moe_layers and g.k <= g.n_experts and g.slot_bytes >= max(g.expert_bytes)
    assert g.slot_bytes % 4096 == 0 and g.token_expert_bytes == g.k * sum(g.extent_bytes)
    assert g.trunk_active_bytes <= g.trunk_bytes + g.embd_bytes
    p = plan_for(g, Box(32 * GiB, 24 * GiB), tokens=16)
    assert p.exit_code == 0 and p.prediction is not None and p.memory.placement.supported
    pr = p.prediction
    assert 0 < pr.tok_s_low <= pr.tok_s_high < math.inf
    assert {t.name for t in pr.terms} == {"storage", "first_reads", "warm_start", "pcie", "experts",
                                          "expert_overhead", "trunk", "attention", "dispatch",
                                          "read_cpu"}
    json.dumps(plan_to_dict(p))


def test_glm_air_geometry() -> None:
    g = like("GLM-4.5-Air")
    assert (g.n_layers, g.n_nextn, len(g.moe_layers), g.n_experts, g.k) == (46, 1, 45, 128, 8)
    assert g.moe_layers[0] == 1                       # one leading dense block
    assert g.nextn_expert_bytes > 0 and g.total_expert_bytes > g.decode_expert_bytes * 0.9


def test_unknown_like_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="not a known model"):
        geometry_from_like("GPT-5-MoE")


# --- the budget ----------------------------------------------------------------------------------

def test_budget_glm_air_32g_24g_by_hand() -> None:
    g = like("GLM-4.5-Air")
    m = layout(g, Box(32 * GiB, 24 * GiB, ctx=8192), "gpu", "quant")
    pl = m.placement
    assert (pl.gpu, pl.trunk, pl.experts, pl.supported) == (True, "gpu", "gpu", True)
    slot, k = g.slot_bytes, g.k
    ram, vram = m.ram, m.vram
    assert ram.item("os_headroom") == 4 * GiB                       # 32 GiB / 8 > 3 GiB
    assert ram.item("runtime") == memory.RUNTIME_OVERHEAD + memory.RUNTIME_OVERHEAD_CUDA
    assert ram.item("staging") == (k + 1) * slot and m.staging_slots == 9   # min(16, k) + 1
    assert ram.item("trunk") == 0                  # the NextN block's trunk: not loaded
    assert vram.item("trunk") == g.loaded_trunk_bytes == g.trunk_bytes - g.nextn_trunk_bytes
    assert m.kv_type == "bf16" and vram.item("kv_cache") == 1_543_503_872
    assert vram.item("reserve") == int(24 * GiB * 0.05)
    assert ram.tier_slots == (32 * GiB - ram.fixed) // slot
    assert not m.pinned                                             # above RAM/4
    assert m.host_slab == ram.tier_bytes + (k + 1) * slot
    assert vram.tier_slots == (24 * GiB - vram.fixed) // slot
    for pool in (ram, vram):
        assert pool.fixed + pool.tier_bytes + pool.unused == pool.total and 0 <= pool.unused < slot


def test_pin_budget_decides_pinning() -> None:
    g = like("GLM-4.5-Air")
    m = layout(g, Box(32 * GiB, 24 * GiB, pin_budget=28 * GiB), "gpu", "quant")
    assert m.pinned and not any(n.code == "not_pinned" for n in m.notes)
    m = layout(g, Box(32 * GiB, 24 * GiB), "gpu", "quant")
    assert any(n.code == "not_pinned" for n in m.notes)


def test_float_trunk_sizes() -> None:
    g = geometry_from_synth(SynthConfig.tiny("qwen3moe", quant="F32"))
    mats = g.trunk_matrices + g.nextn_matrices
    mat_bytes = sum(m.nbytes * m.count for m in mats)
    assert g.trunk_resident("float", 4) == g.trunk_bytes             # F32 stays F32 on the CPU
    assert g.trunk_resident("float", 2) == g.trunk_bytes - mat_bytes // 2      # bf16 on the GPU
    assert g.trunk_resident("quant", 2) == g.trunk_bytes
    air = like("GLM-4.5-Air")           # its NextN block's trunk not loaded: no drafts planned
    el = sum(m.elements * m.count for m in air.trunk_matrices)
    q = sum(m.nbytes * m.count for m in air.trunk_matrices)
    base = air.trunk_bytes - air.nextn_trunk_bytes
    assert air.trunk_resident("float", 2) == base - q + 2 * el
    drafting = dataclasses.replace(air, nextn_loaded=True)
    el_n = sum(m.elements * m.count for m in air.nextn_matrices)
    q_n = sum(m.nbytes * m.count for m in air.nextn_matrices)
    assert drafting.trunk_resident("float", 2) == air.trunk_bytes - q - q_n + 2 * (el + el_n)
    m = layout(air, Box(64 * GiB, 0), "cpu", "float")
    # resident on the CPU: float32 matrices, and not the untied embedding (read a row per token)
    assert not any(m_.tied for m_ in air.trunk_matrices)
    assert m.ram.item("trunk") == base - q + 4 * el - air.embd_bytes
    assert m.kv_type == "f32"


def test_budget_cpu_only() -> None:
    g = like("GLM-4.5-Air")
    m = layout(g, Box(64 * GiB, 0), "cpu", "quant")
    assert m.vram is None and m.placement.trunk == "cpu" and not m.pinned and m.staging_slots == 0
    assert m.ram.item("trunk") == g.loaded_trunk_bytes - g.embd_bytes      # untied embedding
    assert m.ram.item("kv_cache") == memory.kv_reserve(m.kv_bytes)           # its growth peak
    assert m.kv_bytes == 2 * 1_543_503_872                          # float32 KV on the CPU
    assert m.ram.tier_slots == (64 * GiB - m.ram.fixed) // g.slot_bytes
    assert [c.placement.name for c in candidates(g, Box(64 * GiB, 0))] == ["cpu/float", "cpu/quant"]
    assert len(candidates(g, Box(64 * GiB, 8 * GiB))) == 6


def test_headroom_rule_and_override() -> None:
    assert os_headroom(16 * GiB) == 3 * GiB and os_headroom(64 * GiB) == 8 * GiB
    assert os_headroom(8 * GiB) == 2 * GiB and os_headroom(2 * GiB) == GiB // 2
    g = like("Qwen3-30B-A3B")
    m = layout(g, Box(32 * GiB, 0, headroom=GiB), "cpu", "quant")
    assert m.ram.item("os_headroom") == GiB


def test_trunk_too_big_for_vram_stays_in_ram() -> None:
    g = like("DeepSeek-V3")                            # trunk ~16.8 GiB quantized
    box = Box(64 * GiB, 12 * GiB)
    m = layout(g, box, "gpu", "quant")
    assert not m.runnable
    note = next(n for n in m.notes if n.code == "trunk_not_in_vram")
    assert "the trunk alone needs 16.8 GiB (quant) of 12.0 GiB VRAM" in note.text
    assert "keep the trunk in RAM" in note.text
    h = layout(g, box, "hybrid", "quant")
    assert h.runnable and h.placement.trunk == "cpu" and h.placement.experts == "gpu"
    assert h.ram.item("trunk") == g.loaded_trunk_bytes - g.embd_bytes and h.vram.item("trunk") == 0
    p = plan_for(g, box, tokens=16)
    assert p.memory.placement.where == "cpu"           # what expert run can do
    assert any(n.code == "trunk_not_in_vram" for n in p.notes)


def test_kv_too_big_names_the_context_that_fits() -> None:
    g = like("GLM-4.5-Air")
    m = layout(g, Box(64 * GiB, 12 * GiB, ctx=131072), "gpu", "quant")
    assert not m.runnable
    note = next(n for n in m.notes if n.code == "kv_not_in_vram")
    ctx = int(note.text.split("with --ctx ")[1].split()[0])
    base = m.vram.item("reserve") + m.vram.item("workspace")
    free = 12 * GiB - base - g.loaded_trunk_bytes
    assert ctx == max_ctx_on_gpu(g, free, "bf16")
    assert kv_cache_bytes(g, ctx, "bf16") <= free < kv_cache_bytes(g, ctx + 1, "bf16")
    assert layout(g, Box(64 * GiB, 12 * GiB, ctx=ctx), "gpu", "quant").runnable


def test_cannot_run_exit_1_with_what_it_needs() -> None:
    g = like("Qwen3-235B-A22B")     # 4 GiB: the KV cache and the runtime alone do not fit
    p = plan_for(g, Box(4 * GiB, 0, prompt_tokens=8000))       # a prompt that fills --ctx
    assert p.exit_code == 1 and p.prediction is None and not p.memory.runnable
    err = [n for n in p.notes if n.level == "error"]
    assert len(err) == 1 and "cannot hold" in err[0].text and "needed" in err[0].text
    d = plan_to_dict(p)
    assert d["status"] == "cannot_run" and d["exit_code"] == 1 and d["prediction"] is None
    assert d["run"] is None


def test_a_cap_below_the_trunk_runs_as_run_does_with_the_trunk_re_read() -> None:
    """Where the cap leaves no room for one layer's experts beside a quantized trunk, ``run``
    still runs (on ``memory.FALLBACK_SLAB``, the cap evicting the trunk's file pages): plan
    says so and predicts the re-reads, never CANNOT RUN; below that the cap evicts the
    runtime's library pages too (a thrash: "working_set_evicted", re-read ``PAGE_REREAD``
    times); it says CANNOT RUN only where even those out leave no room (the resident floor,
    ``memory.runtime_resident``), and for a float trunk (anonymous memory)."""
    from expertfs.runtime.plan.host import budget_batch, run_host_budget

    g = like("Qwen3-30B-A3B")
    slot, k = g.slot_bytes, g.k
    assert memory.FALLBACK_SLAB // slot >= k
    probe = 8 * GiB
    fixed = probe - run_host_budget(g, 512, "cpu", "quant", limit=probe, source="limit").room
    short = fixed + k * slot // 2                     # room for half a layer's experts
    box = Box(short, 0, ctx=512, limit_source="limit", n_predict=16)
    m = layout(g, box, "cpu", "quant")
    assert m.runnable and m.ram.tier_slots == memory.FALLBACK_SLAB // slot
    assert m.trunk_evicted == memory.FALLBACK_SLAB - k * slot // 2
    assert any(n.code == "trunk_evicted" and n.level == "warning" for n in m.notes)
    p = plan_for(g, box, tokens=16, trunk="quant")
    assert p.exit_code == 0 and p.memory.trunk_evicted == m.trunk_evicted
    t = p.prediction.term("trunk_reads")
    assert t.slow_s > t.fast_s > 0 and p.prediction.slow_s > t.slow_s
    # a pass re-reads TRUNK_REREAD times what is evicted (the page cache's refaults), at most all
    whole, (fast_x, slow_x) = m.ram.item("trunk"), TRUNK_REREAD
    assert trunk_reread_bytes(m) == (min(whole, int(slow_x * m.trunk_evicted)),
                                     min(whole, int(fast_x * m.trunk_evicted)))
    assert 0 < trunk_reread_bytes(m)[1] < trunk_reread_bytes(m)[0] < whole
    # a decode token's slow end: at most what run streams instead (runtime.model.trunk_stream)
    units = g.trunk_units()
    assert len(units) == g.n_layers + 1 and sum(units) == g.trunk_active_bytes
    streamed = int(sum(units) * memory.trunk_stream_share(units, m.trunk_evicted))
    slow, fast = trunk_reread_bytes(m, g)
    assert fast == trunk_reread_bytes(m)[1] and slow == max(fast, min(trunk_reread_bytes(m)[0],
                                                                     streamed))
    assert not layout(g, box, "cpu", "float").runnable
    # below the trunk out of memory, the runtime's library pages go next: a thrash, not a kill
    pages = memory.RUNTIME_OVERHEAD - memory.runtime_resident(g.n_vocab, g.n_layers + g.n_nextn)
    assert 0 < pages < memory.RUNTIME_OVERHEAD
    squeezed = Box(fixed - m.ram.item("trunk") + memory.FALLBACK_SLAB // 2, 0, ctx=512,
                   limit_source="limit", n_predict=16)
    th = layout(g, squeezed, "cpu", "quant")
    assert th.runnable and th.trunk_evicted == m.ram.item("trunk")
    assert th.pages_evicted == memory.FALLBACK_SLAB // 2 and th.ram.tier_slots == m.ram.tier_slots
    assert [n.code for n in th.notes if n.level == "warning"][0] == "working_set_evicted"
    fast_p, slow_p = (int(x * th.pages_evicted) for x in PAGE_REREAD)
    assert trunk_reread_bytes(th) == (min(whole, int(slow_x * th.trunk_evicted)) + slow_p,
                                      min(whole, int(fast_x * th.trunk_evicted)) + fast_p)
    slower = plan_for(g, squeezed, tokens=16, trunk="quant").prediction
    assert slower.slow_s > p.prediction.slow_s and slower.fast_s >= p.prediction.fast_s
    # CANNOT RUN only where even those pages out leave no room: the resident floor, with the
    # KV cache the run writes (a prompt that fills --ctx: all of it)
    floor = fixed - m.ram.item("trunk") - pages + memory.FALLBACK_SLAB // 2
    none = Box(floor, 0, ctx=512, limit_source="limit", prompt_tokens=500, n_predict=12)
    gone = layout(g, none, "cpu", "quant")
    assert not gone.runnable and gone.trunk_evicted == 0 and gone.pages_evicted == 0
    assert any(n.code == "ram_too_small" for n in gone.notes)
    # a short run there writes a few positions of the cache: it fits, up to a context it names
    batch = budget_batch(20)
    fixed20 = probe - run_host_budget(g, 512, "cpu", "quant", limit=probe, source="limit",
                                      batch=batch).room
    floor20 = fixed20 - m.ram.item("trunk") - pages + memory.FALLBACK_SLAB // 2
    short_run = layout(g, Box(floor20, 0, ctx=512, limit_source="limit", prompt_tokens=20,
                              n_predict=12), "cpu", "quant")
    assert short_run.runnable and short_run.trunk_evicted == m.ram.item("trunk")
    ctx_note = [n for n in short_run.notes if n.code == "ctx_beyond_working_set"]
    assert len(ctx_note) == 1 and ctx_note[0].level == "warning"
    most = int(ctx_note[0].text.split("--ctx ")[-1].split()[0])
    assert 32 <= most < 512
    for n, runs in ((most, True), (most + 1, False)):
        at = Box(floor20, 0, ctx=512, limit_source="limit", prompt_tokens=20, n_predict=n - 20)
        assert layout(g, at, "cpu", "quant").runnable == runs


def test_small_ram_tier_warns_disk_bound() -> None:
    g = like("Qwen3-235B-A22B")
    m = layout(g, Box(16 * GiB, 0), "cpu", "quant")
    assert m.runnable
    assert any(n.code == "tiers_below_token" and "disk-bound" in n.text for n in m.notes)


def test_tiny_vram_cannot_host_the_gpu_placements() -> None:
    g = like("Mixtral-8x7B")                           # 109 MiB extents
    box = Box(64 * GiB, GiB)
    for where in ("gpu", "hybrid"):
        m = layout(g, box, where, "quant")
        assert not m.runnable and any(n.code == "vram_too_small" for n in m.notes)
    p = plan_for(g, box, tokens=16)
    assert p.memory.placement.where == "cpu" and p.exit_code == 0


def test_tiers_never_exceed_the_experts() -> None:
    g = like("Qwen3-30B-A3B")
    m = layout(g, Box(256 * GiB, 80 * GiB), "gpu", "quant")
    v, r = m.tier_slots
    assert v == g.n_decode_experts and r == 0
    m = layout(g, Box(256 * GiB, 8 * GiB), "gpu", "quant")
    assert sum(m.tier_slots) == g.n_decode_experts
    assert any(n.code == "all_experts_fit" for n in m.notes)


def test_choose_prefers_supported_and_fastest() -> None:
    def opt(where: str, lo: float, hi: float, runnable: bool = True):
        mem = layout(like("Qwen3-30B-A3B"), Box(64 * GiB, 24 * GiB), where, "quant")
        from dataclasses import replace
        mem = replace(mem, runnable=runnable)
        pred = type("P", (), {"tok_s_low": lo, "tok_s_high": hi})()
        return Option(mem, None, pred if runnable else None)
    a, b, c = opt("gpu", 1, 4), opt("cpu", 2, 3), opt("hybrid", 5, 9)
    assert choose([a, b, c]) is b                      # sqrt(6) > sqrt(4); hybrid unsupported
    assert choose([a, c]) is a
    assert choose([c]) is c and choose([c], forced=True) is c


@pytest.mark.parametrize("field, value", [("ram", 0), ("vram", -1), ("ctx", 0), ("kv_type", "x"),
                                          ("pin_budget", -1), ("headroom", 64 * GiB)])
def test_box_rejects_bad_values(field: str, value) -> None:
    kw = dict(ram=32 * GiB, vram=0)
    kw[field] = value
    with pytest.raises(UsageError):
        Box(**kw)


# --- the prediction ------------------------------------------------------------------------------

def test_prediction_arithmetic() -> None:
    g = like("GLM-4.5-Air")
    box = Box(32 * GiB, 24 * GiB, pin_budget=32 * GiB)
    mem = layout(g, box, "gpu", "quant")
    assert mem.pinned
    mib = 2**20
    slow = Routing("a", True, "wlfu", 100, 0.5, 0.2, 0.3, 1000 * mib, 2000 * mib, 500 * mib)
    fast = Routing("b", True, "wlfu", 100, 0.7, 0.2, 0.1, 400 * mib, 900 * mib, 900 * mib)
    rates = Rates(Range(1.0, 4.0, "t"), Range(10.0, 20.0, "t"), stated_cpu(), stated_gpu(["Q4_K"]))
    pr = predict(g, mem, RoutingRange(slow, fast), rates, box)
    t = {x.name: x for x in pr.terms}
    assert t["storage"].slow_s == pytest.approx(1000 * mib / 1e9)
    assert t["storage"].fast_s == pytest.approx(400 * mib / 4e9)
    assert t["pcie"].slow_s == pytest.approx(2000 * mib / 10e9)        # the larger direction
    assert t["pcie"].fast_s == pytest.approx(900 * mib / 20e9)
    assert pr.slow_s == pytest.approx(sum(x.slow_s for x in pr.terms))
    compute = sum(x.fast_s for x in pr.terms if x.name not in ("storage", "first_reads", "pcie"))
    drive = t["storage"].fast_s + t["first_reads"].fast_s
    assert pr.fast_s == pytest.approx(max(compute, drive, t["pcie"].fast_s))
    assert pr.tok_s_low == pytest.approx(1 / pr.slow_s) and pr.tok_s_low < pr.tok_s_high
    assert pr.dominant_slow in ("storage", "first_reads")
    assert all(x.slow_s >= x.fast_s for x in pr.terms)
    kv = kv_cache_bytes(g, 8192, "bf16")
    assert t["attention"].slow_s == pytest.approx(kv / (rates.gpu.mem_gbps.slow * 1e9))
    # a pageable RAM tier halves the upload rate
    pageable = predict(g, layout(g, Box(32 * GiB, 24 * GiB), "gpu", "quant"),
                       RoutingRange(slow, fast), rates, box)
    assert pageable.term("pcie").slow_s == pytest.approx(2 * t["pcie"].slow_s)


def test_attention_moves_the_kda_state_both_ways() -> None:
    """A recurrent (KDA) layer reads its fixed state and writes it back each token: the
    attention term moves the cache once and the state twice."""
    g = like("GLM-5.3-Flash")
    assert g.state_bytes > 0
    box = Box(512 * GiB, 0, ctx=4096)
    mem = layout(g, box, "cpu", "quant")
    mib = 2**20
    r = Routing("a", True, "wlfu", 100, 1.0, 0.0, 0.0, 0, 0, 0)
    rates = Rates(Range(1.0, 4.0, "t"), Range(10.0, 20.0, "t"), stated_cpu(), stated_gpu(["Q4_K"]))
    t = predict(g, mem, RoutingRange(r, r), rates, box).term("attention")
    moved = kv_cache_bytes(g, 4096, mem.kv_type) + g.state_bytes
    assert t.slow_s == pytest.approx(moved / (rates.cpu.mem_gbps.slow * 1e9))
    assert f"{moved / mib:.0f} MiB" in t.detail and "KDA state read and written" in t.detail


def test_cpu_run_has_no_pcie_term_and_is_cpu_bound() -> None:
    g = like("Qwen3-30B-A3B")
    p = plan_for(g, Box(64 * GiB, 0), where="cpu", trunk="quant")
    names = [t.name for t in p.prediction.terms]
    assert "pcie" not in names
    assert any(n.code == "cpu_bound" for n in p.notes)


#: how far a larger box's figure may fall below a smaller one's (see ``_grid_check``)
SHORT_RUN_SLACK = 0.005


def _grid_check(g, boxes, replays, where="auto", trunk="auto") -> int:
    """Both ends monotone for a fixed placement; the chosen figure (geometric mean) for auto.
    Except where the RAM tier first holds every expert: its prompt reads through the spare
    slots (``cache.window``), the first token's fresh memory moved into the decode's start.
    Within ``SHORT_RUN_SLACK``: over a short run the warm start's CPU grows with the RAM tier
    it fills (``coldstart.start_terms``), and can outweigh the few misses a larger tier saves."""
    prev, seen, windowed = (0.0, 0.0), 0, False
    for box in boxes:
        p = plan_for(g, box, replays=replays, where=where, trunk=trunk)
        if p.prediction is None:
            assert p.exit_code == 1 and seen == 0      # only the smallest boxes cannot run
            continue
        seen += 1
        if window_spare(g, p.memory, 1.0) and not windowed:
            prev, windowed = (0.0, 0.0), True
        lo, hi = p.prediction.tok_s_low, p.prediction.tok_s_high
        if where == "auto":
            cur = (math.sqrt(lo * hi),) * 2
        else:
            cur = (lo, hi)
        low = 1 - SHORT_RUN_SLACK
        assert cur[0] >= prev[0] * low and cur[1] >= prev[1] * low, (box, cur, prev)
        prev = cur
    return seen


@pytest.mark.parametrize("vram, where", [(0, "cpu"), (24, "gpu"), (24, "auto")])
def test_more_ram_never_predicts_fewer_tokens(vram: int, where: str) -> None:
    g = like("GLM-4.5-Air")
    replays = {s: synthetic_replay(g, s, tokens=40) for s in ("diffuse", "mixed")}
    boxes = [Box(r * GiB, vram * GiB) for r in (12, 16, 24, 32, 48, 64, 96, 128)]
    trunk = "auto" if where == "auto" else "quant"
    assert _grid_check(g, boxes, replays, where, trunk) >= 6


def test_more_vram_never_predicts_fewer_tokens() -> None:
    g = like("Qwen3-235B-A22B")
    replays = {s: synthetic_replay(g, s, tokens=24) for s in ("diffuse", "mixed")}
    boxes = [Box(32 * GiB, v * GiB) for v in (12, 16, 24, 48)]
    assert _grid_check(g, boxes, replays, "gpu", "quant") == 4
    assert _grid_check(g, [Box(32 * GiB, 0)] + boxes, replays) == 5


def test_json_schema() -> None:
    p = plan_for(like("GLM-4.5-Air"), Box(32 * GiB, 24 * GiB, label="test"))
    d = json.loads(json.dumps(plan_to_dict(p)))
    assert d["schema"] == "expertfs.store.plan/1" and d["status"] == "fits" and d["exit_code"] == 0
    assert set(d) >= {"model", "box", "placement", "budget", "rates", "routing", "prediction",
                      "notes", "assumptions", "measurements"}
    assert set(d["placement"]) == {"where", "trunk_mode", "trunk", "experts", "gpu", "supported"}
    assert d["run"].startswith("expertfs run STORE --device cuda --ram ")
    assert {a["placement"] for a in d["alternatives"]} | {d["placement"]["where"] + "/"
                                                          + d["placement"]["trunk_mode"]} == {
        "gpu/float", "gpu/quant", "hybrid/float", "hybrid/quant", "cpu/float", "cpu/quant"}
    for pool in ("ram", "vram"):
        b = d["budget"][pool]
        assert b["fixed_bytes"] + b["tier_bytes"] + b["unused_bytes"] == b["total_bytes"]
        assert all(set(i) == {"name", "bytes", "note"} for i in b["items"])
        assert b["tier_bytes"] == b["tier_experts"] * d["budget"]["slot_bytes"]
    pr = d["prediction"]
    assert pr["tok_s_low"] <= pr["tok_s_high"]
    assert set(pr["terms"]) == {"storage", "first_reads", "warm_start", "pcie", "experts",
                                "expert_overhead", "trunk", "attention", "dispatch", "read_cpu"}
    for t in pr["terms"].values():
        assert {"slow_s", "fast_s", "detail", "share_slow"} <= set(t)
    assert sum(t["share_slow"] for t in pr["terms"].values()) == pytest.approx(1.0)
    for end in ("slow", "fast"):
        r = d["routing"][end]
        assert r["synthetic"] is True
        assert r["vram_hit_rate"] + r["ram_hit_rate"] + r["miss_rate"] == pytest.approx(1.0)
    assert d["rates"]["storage_gbps"]["source"].startswith("stated default")
    assert {n["code"] for n in d["notes"]} >= {"routing_synthetic", "storage_default"}
    assert all(set(n) == {"level", "code", "text"} for n in d["notes"])


# --- storage from a bench io profile ----------------------------------------------------------------

def _profile(auto: str | None = "direct") -> dict:
    pts = [{"backend": "direct", "qd": 1, "gbps": 0.8}, {"backend": "direct", "qd": 8, "gbps": 2.5},
           {"backend": "direct", "qd": 32, "gbps": 3.1, "lat_us": {"p99": 9000.0}},
           {"backend": "buffered", "qd": 8, "gbps": 2.9}, {"backend": "buffered", "qd": 32, "gbps": 3.5}]
    return {"points": pts, "read_size": 12 << 20, "auto": {"backend": auto} if auto else None}


def test_storage_from_profile_uses_auto_and_queue_depths() -> None:
    r, d = storage_from_profile(_profile(), 8)
    assert (r.slow, r.fast, d["backend"], d["slow_qd"], d["fast_qd"]) == (2.5, 3.1, "direct", 8, 32)
    r, d = storage_from_profile(_profile(None), 8)      # no auto: best at the demand depth
    assert (r.slow, r.fast, d["backend"]) == (2.9, 3.5, "buffered")
    r, _ = storage_from_profile(_profile(), 4)          # k below every depth but 1
    assert r.slow == 0.8


@pytest.mark.parametrize("bad", [{}, {"points": []}, {"points": [{"qd": 1}]},
                                 {"points": [{"backend": "direct", "qd": 1, "gbps": 0}]}])
def test_storage_from_profile_errors(bad) -> None:
    with pytest.raises(UsageError):
        storage_from_profile(bad, 8)


# --- routing --------------------------------------------------------------------------------------

def _tiny() -> Geometry:
    return geometry_from_synth(SynthConfig.tiny("glm4moe", n_layers=4, n_experts=16, n_expert_used=4))


def test_route_all_miss_without_tiers_and_full_hit_with_everything() -> None:
    g = _tiny()
    rp = synthetic_replay(g, "mixed", tokens=40)
    r = route(g, rp, 0, 0, experts_on_gpu=True, label="x", synthetic=True)
    assert r.miss_rate == 1.0 and r.nvme_bytes_per_token == r.h2d_bytes_per_token
    assert r.nvme_bytes_per_token == pytest.approx(g.token_expert_bytes)
    full = route(g, rp, 0, g.n_decode_experts, experts_on_gpu=False, label="x", synthetic=True)
    assert full.miss_rate == 0.0 and full.nvme_bytes_per_token == 0.0


def test_trace_replay_maps_block_indices(tmp_path) -> None:
    g = _tiny()                                        # 1 dense block + 3 MoE, NextN block 4
    assert g.moe_layers == (1, 2, 3)
    compact = tmp_path / "c.eftrace"
    write_synthetic(compact, parse_spec("hot,n_tokens=24,n_layers=3,n_experts=16,k=4"))
    rc = trace_replay(g, str(compact))
    assert rc.header.expert_bytes == g.extent_bytes and rc.n_tokens == 24
    blocks = tmp_path / "b.eftrace"                    # block-indexed, NextN rows included
    write_synthetic(blocks, parse_spec("hot,n_tokens=24,n_layers=5,n_experts=16,k=4"))
    rb = trace_replay(g, str(blocks))
    assert {k // 16 for row in rb.rows for k in row} == {1, 2, 3}
    assert rb.header.expert_bytes[0] == 0 and rb.header.expert_bytes[1] == g.extent_bytes[0]


def test_trace_of_another_model_is_refused(tmp_path) -> None:
    t = tmp_path / "other.eftrace"
    write_synthetic(t, parse_spec("hot,n_tokens=8,n_layers=3,n_experts=32,k=4"))
    with pytest.raises(UsageError, match="recorded with this model"):
        trace_replay(_tiny(), str(t))
    with pytest.raises(UsageError, match="no such trace"):
        trace_replay(_tiny(), str(tmp_path / "missing.eftrace"))


def test_unknown_synthetic_preset() -> None:
    with pytest.raises(UsageError, match="preset"):
        synthetic_replay(_tiny(), "spiky")


def test_bound_prunes_without_changing_the_choice() -> None:
    g = like("Qwen3-235B-A22B")
    box = Box(32 * GiB, 24 * GiB)
    replays = {s: synthetic_replay(g, s, tokens=16) for s in ("diffuse", "mixed")}
    calls = []

    def routing_for(mem):
        calls.append(mem.placement.name)
        v, r = mem.tier_slots
        return RoutingRange(*[route(g, replays[s], v, r, experts_on_gpu=mem.placement.gpu,
                                    label=s, synthetic=True) for s in ("diffuse", "mixed")])

    rates = rates_for(g)
    opts = plan_options(g, box, rates, routing_for)
    full = [predict_option_full(g, box, o.memory, rates, routing_for) for o in opts]
    assert choose(opts).memory.placement.name == choose(full).memory.placement.name
    pruned = [o for o in opts if o.bound is not None]
    assert pruned and all(o.prediction is None for o in pruned)
    for o in pruned:                                   # the bound really bounds
        f = next(x for x in full if x.memory is o.memory)
        assert f.score <= o.bound * (1 + 1e-9)


def predict_option_full(g, box, mem, rates, routing_for):
    from expertfs.runtime.plan.predict import Option, predict_option
    return predict_option(g, box, mem, rates, routing_for(mem)) if mem.runnable else Option(mem)


@pytest.mark.parametrize("name, ram, ctx", [("Qwen3-30B-A3B", 24 * GiB, 4096),
                                            ("Qwen3-30B-A3B", 6 * GiB, 512),
                                            ("GLM-4.5-Air", 32 * GiB, 8192),
                                            ("GLM-5.3-Flash", 48 * GiB, 4096),
                                            ("DeepSeek-V3", 64 * GiB, 2048)])
@pytest.mark.parametrize("source", ["physical", "limit"])
def test_plan_ram_pool_is_runs_host_budget(name, ram, ctx, source) -> None:
    """The plan's CPU budget is ``run_host_budget``, the function ``expertfs run`` sizes its
    default ``--ram`` with: the same headroom, runtime, trunk, KV reserve (with the fixed
    recurrent state of glm5-next's KDA layers) and workspace, and the same tier."""
    from expertfs.runtime.cache.sizing import window_slots
    from expertfs.runtime.plan.host import run_host_budget

    g = like(name)
    m = layout(g, Box(ram, 0, ctx=ctx, limit_source=source), "cpu", "quant")
    hb = run_host_budget(g, ctx, "cpu", "quant", limit=ram, source=source)
    assert dict(hb.items()) == {i.name: i.nbytes for i in m.ram.items}
    assert m.ram.tier_slots == min(hb.slab // g.slot_bytes, g.n_decode_experts)
    window = window_slots(g.slot_bytes, g.k, g.n_experts)     # a tier of every expert's spare
    assert m.ram.tier_bytes // g.slot_bytes == min(hb.slab // g.slot_bytes,
                                                   g.n_decode_experts + window)
    assert (hb.headroom == 0) == (source == "limit")
    assert hb.kv == memory.kv_reserve(kv_cache_bytes(g, ctx, "f32"), g.state_bytes)
    if name == "GLM-5.3-Flash":
        assert g.state_bytes > 0 and hb.kv < int(1.5 * kv_cache_bytes(g, ctx, "f32"))
    # a GPU run: no trunk or KV cache in RAM, staging slots carved from the slab
    v = layout(g, Box(ram, 24 * GiB, ctx=ctx, limit_source=source), "gpu", "quant")
    if v.runnable:
        hv = run_host_budget(g, ctx, "gpu", "quant", limit=ram, source=source,
                             vram_tier_experts=v.vram.tier_slots)
        assert v.host_slab <= hv.slab < v.host_slab + g.slot_bytes


def test_the_budget_holds_a_prompt_batch() -> None:
    """The workspace holds a prompt batch's activations (``prefill_activation_bytes``): none for
    one token, growing with the batch up to ``--ctx``, far more for MLA's 128 heads than for a
    GQA model; plan budgets min(256, --prompt-tokens) as run does for its prompt. The MLA
    chunk sizes it assumes are the model's."""
    from expertfs.runtime.model import mla
    from expertfs.runtime.plan.host import (MLA_QUERIES, MQA_SCORES, budget_batch,
                                            prefill_activation_bytes, run_host_budget,
                                            workspace_bytes)
    assert (MQA_SCORES, MLA_QUERIES) == (mla.MQA_CHUNK, mla.MLA_QUERY_CHUNK)
    ds, qw = like("DeepSeek-V3"), like("Qwen3-30B-A3B")
    for g in (ds, qw):
        assert prefill_activation_bytes(g, 4096, 1) == 0
        a, b = prefill_activation_bytes(g, 4096, 64), prefill_activation_bytes(g, 4096, 256)
        assert 0 < a < b == prefill_activation_bytes(g, 256, 4096)
        assert workspace_bytes(g, 512, "cpu", 256) - workspace_bytes(g, 512, "cpu") == \
            prefill_activation_bytes(g, 512, 256)
        one = run_host_budget(g, 512, "cpu", "quant", limit=64 * GiB, source="limit", batch=1)
        full = run_host_budget(g, 512, "cpu", "quant", limit=64 * GiB, source="limit")
        assert full.workspace - one.workspace == prefill_activation_bytes(g, 512, 256)
    assert prefill_activation_bytes(ds, 4096, 256) > 4 * prefill_activation_bytes(qw, 4096, 256)
    assert (budget_batch(0), budget_batch(40), budget_batch(512)) == (256, 40, 256)
    ram = [layout(ds, Box(64 * GiB, 0, ctx=512, prompt_tokens=p, limit_source="limit"), "cpu",
                  "quant").ram for p in (16, 512)]
    assert ram[0].item("workspace") < ram[1].item("workspace")
    # mHC (GLM-5.3-Flash): a token carries hc_mult residual streams, each a hidden state
    from dataclasses import replace
    g5 = like("GLM-5.3-Flash")
    assert g5.hc_streams == 4 and qw.hc_streams == ds.hc_streams == 1
    one_stream = replace(g5, hc_streams=1)
    assert prefill_activation_bytes(g5, 4096, 256) - prefill_activation_bytes(
        one_stream, 4096, 256) == 4 * 6 * 256 * g5.n_embd * 3


def test_storage_profile_keeps_the_reads_cpu_into_memory_in_use() -> None:
    """The plain points' CPU per GB (reads into a buffer in use, as the decode's misses) is kept
    beside the fresh-memory figure: its cheapest the fast end's, its dearest the slow end's;
    without it the stated default."""
    from expertfs.runtime.plan.rates import miss_cpu_from, stated_miss_cpu
    p = _profile()
    for pt, us in zip(p["points"], (100.0, 300.0, 200.0, 900.0, 900.0)):
        pt.update(cpu_us_per_read=us, reads=10, bytes=10 * (1 << 20))
    _, d = storage_from_profile(p, 8)
    per_gb = [us * 1e-6 / (1 << 20) * 1e9 for us in (100.0, 300.0)]
    assert d["cpu_s_per_gb_reused"] == pytest.approx(per_gb[0])
    assert d["cpu_s_per_gb_reused_slow"] == pytest.approx(per_gb[1])
    r = miss_cpu_from(d, "probe")
    assert (r.slow, r.fast) == (pytest.approx(per_gb[1]), pytest.approx(per_gb[0]))
    assert miss_cpu_from({}, "probe") == stated_miss_cpu()


def test_unseen_experts_share_the_good_turing_routes() -> None:
    """The learned popularity keeps every count and gives a layer's never-chosen experts, evenly,
    as many routes as the experts chosen exactly once (at least ``UNSEEN_ROUTES``), not a
    route each: a short history that kept to a few experts leaves the rest little."""
    from expertfs.runtime.plan.routing import UNSEEN_ROUTES, _popularity
    g = _tiny()
    a, b = g.moe_layers[0], g.moe_layers[1]
    usage = {(a, 0): 30.0, (a, 1): 1.0, (a, 2): 1.0, (a, 3): 4.0, (b, 5): 9.0}
    pop = _popularity(g, usage)
    assert list(pop[0, :4]) == [30.0, 1.0, 1.0, 4.0] and pop[1, 5] == 9.0
    assert pop[0, 4:].sum() == pytest.approx(2.0) and len(set(pop[0, 4:])) == 1
    assert pop[1, [e for e in range(g.n_experts) if e != 5]].sum() == pytest.approx(UNSEEN_ROUTES)
    assert (pop > 0).all()                # trace.synth draws only positive popularities


def test_the_slow_end_prices_a_request_unlike_the_learned_ones() -> None:
    """``NEW_REQUEST``'s replay (the slow end) gives every expert a route of prior over its
    count; the fast end's keeps Good–Turing's share for the unseen; both replays build."""
    from expertfs.runtime.plan.routing import (NEW_REQUEST, UNSEEN_ROUTES, _popularity,
                                               usage_replay)
    g = _tiny()
    a = g.moe_layers[0]
    usage = {(a, e): 8.0 for e in range(g.k + 1)}
    new = _popularity(g, usage, new=True)
    assert new[0, 0] == 8.0 + UNSEEN_ROUTES and new[0, -1] == UNSEEN_ROUTES
    assert _popularity(g, usage)[0, -1] < new[0, -1]
    for spec in ("diffuse" + NEW_REQUEST, "mixed"):
        assert usage_replay(g, usage, spec, tokens=16).n_tokens == 16
