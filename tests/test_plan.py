"""``expertfs.runtime.plan``: budget arithmetic, KV sizes, prediction terms, monotonicity, presets.

Everything here is arithmetic on known geometries with stated rates (no timing assertions); the
synthetic routing is kept to a few dozen tokens so the simulator runs in well under a second.
"""

from __future__ import annotations

import json
import math

import pytest

from expertfs.errors import UsageError
from expertfs.runtime.plan import (GiB, Box, Geometry, Matrix, Range, Rates, Routing, RoutingRange,
                                   kv_bytes_per_token, kv_cache_bytes, make_plan, max_ctx_on_gpu,
                                   os_headroom, plan_memory, plan_to_dict, predict, stated_cpu,
                                   stated_gpu, stated_pcie, stated_storage, storage_from_profile)
from expertfs.runtime.plan_model import geometry_from_like, geometry_from_synth
from expertfs.runtime.plan_routing import route, synthetic_replay, trace_replay
from expertfs.runtime.trace_synth import parse_spec, write_synthetic
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


def plan_for(g: Geometry, box: Box, tokens: int = 32, replays=None):
    mem = plan_memory(g, box)
    if not mem.runnable:
        return make_plan(g, box, mem, None, None)
    v, r = mem.tier_slots
    replays = replays or {s: synthetic_replay(g, s, tokens=tokens) for s in ("diffuse", "mixed")}
    ends = [route(g, replays[s], v, r, experts_on_gpu=mem.placement.experts == "gpu",
                  label=f"synthetic '{s}'", synthetic=True) for s in ("diffuse", "mixed")]
    return make_plan(g, box, mem, rates_for(g), RoutingRange(*ends))


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
    assert kv_cache_bytes(g, 8192) == 18 * 8192 * per_layer + 18 * 128 * per_layer
    assert kv_cache_bytes(g, 100) == 36 * 100 * per_layer       # below the window: all layers grow


def test_kv_errors() -> None:
    with pytest.raises(UsageError, match="KV cache type"):
        kv_cache_bytes(like("GLM-4.5-Air"), 10, "q3")


# --- geometry ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", preset_names())
def test_like_every_preset_plans(name: str) -> None:
    g = like(name)
    assert g.moe_layers and g.k <= g.n_expert and g.slot_bytes >= max(g.expert_bytes)
    assert g.slot_bytes % 4096 == 0 and g.token_expert_bytes == g.k * sum(g.extent_bytes)
    assert g.trunk_active_bytes <= g.trunk_bytes + g.embd_bytes
    p = plan_for(g, Box(32 * GiB, 24 * GiB), tokens=16)
    assert p.exit_code == 0 and p.prediction is not None
    pr = p.prediction
    assert 0 < pr.tok_s_low <= pr.tok_s_high < math.inf
    assert {t.name for t in pr.terms} == {"storage", "pcie", "experts", "trunk", "attention", "dispatch"}
    json.dumps(plan_to_dict(p))


def test_glm_air_geometry() -> None:
    g = like("GLM-4.5-Air")
    assert (g.n_layer, g.n_nextn, len(g.moe_layers), g.n_expert, g.k) == (46, 1, 45, 128, 8)
    assert g.moe_layers[0] == 1                       # one leading dense block
    assert g.nextn_expert_bytes > 0 and g.total_expert_bytes > g.decode_expert_bytes * 0.9


def test_unknown_like_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="not a known model"):
        geometry_from_like("GPT-5-MoE")


# --- the budget ----------------------------------------------------------------------------------

def test_budget_glm_air_32g_24g_by_hand() -> None:
    g = like("GLM-4.5-Air")
    m = plan_memory(g, Box(32 * GiB, 24 * GiB, ctx=8192))
    pl = m.placement
    assert (pl.gpu, pl.trunk, pl.experts, pl.pinned) == (True, "gpu", "gpu", True)
    slot, k = g.slot_bytes, g.k
    ram, vram = m.ram, m.vram
    assert ram.item("os_headroom") == 4 * GiB                       # 32 GiB / 8 > 3 GiB
    assert ram.item("runtime") == 768 * 2**20 + GiB
    assert ram.item("staging") == 2 * k * slot
    assert ram.item("trunk") == 0 and vram.item("trunk") == g.trunk_bytes
    assert vram.item("kv_cache") == 1_543_503_872
    assert vram.item("reserve") == int(24 * GiB * 0.05)
    assert ram.tier_slots == (16 * GiB) // slot                       # pinned cap: half of RAM
    assert m.capped_bytes == 32 * GiB - ram.fixed - 16 * GiB
    free_dev = 24 * GiB - vram.fixed
    assert vram.tier_slots == free_dev // slot
    for pool in (ram, vram):
        assert pool.fixed + pool.tier_bytes + pool.unused == pool.total and pool.unused >= 0


def test_budget_cpu_only_not_capped() -> None:
    g = like("GLM-4.5-Air")
    m = plan_memory(g, Box(64 * GiB, 0))
    assert m.vram is None and m.placement.trunk == "cpu" and not m.placement.pinned
    assert m.ram.item("trunk") == g.trunk_bytes and m.ram.item("kv_cache") == m.kv_bytes
    assert m.ram.tier_slots == (64 * GiB - m.ram.fixed) // g.slot_bytes
    assert m.ram.unused < g.slot_bytes


def test_headroom_rule_and_override() -> None:
    assert os_headroom(16 * GiB) == 3 * GiB and os_headroom(64 * GiB) == 8 * GiB
    g = like("Qwen3-30B-A3B")
    m = plan_memory(g, Box(32 * GiB, 0, headroom=GiB))
    assert m.ram.item("os_headroom") == GiB


def test_trunk_too_big_for_vram_stays_in_ram() -> None:
    g = like("DeepSeek-V3")                            # trunk ~16.8 GiB
    m = plan_memory(g, Box(64 * GiB, 12 * GiB))
    assert m.placement.trunk == "cpu" and m.placement.experts == "gpu"
    assert m.ram.item("trunk") == g.trunk_bytes and m.vram.item("trunk") == 0
    note = next(n for n in m.notes if n.code == "trunk_not_in_vram")
    assert "the trunk alone needs 16.8 GiB of 12.0 GiB VRAM" in note.text
    assert "holds experts only" in note.text


def test_kv_too_big_names_the_context_that_fits() -> None:
    g = like("GLM-4.5-Air")
    box = Box(64 * GiB, 12 * GiB, ctx=131072)
    m = plan_memory(g, box)
    assert m.placement.trunk == "cpu"
    note = next(n for n in m.notes if n.code == "kv_not_in_vram")
    ctx = int(note.text.split("with --ctx ")[1].split()[0])
    fixed = sum(i.nbytes for i in m.vram.items)
    free = 12 * GiB - fixed - g.trunk_bytes
    assert ctx == max_ctx_on_gpu(g, free, "f16")
    assert kv_cache_bytes(g, ctx) <= free < kv_cache_bytes(g, ctx + 1)
    assert plan_memory(g, Box(64 * GiB, 12 * GiB, ctx=ctx)).placement.trunk == "gpu"


def test_cannot_run_exit_1_with_what_it_needs() -> None:
    g = like("Qwen3-235B-A22B")
    p = plan_for(g, Box(8 * GiB, 0))
    assert p.exit_code == 1 and p.prediction is None and not p.memory.runnable
    err = [n for n in p.notes if n.level == "error"]
    assert len(err) == 1 and "cannot run" in err[0].text and "RAM or more" in err[0].text
    d = plan_to_dict(p)
    assert d["status"] == "cannot_run" and d["exit_code"] == 1 and d["prediction"] is None


def test_small_ram_tier_warns_disk_bound() -> None:
    g = like("Qwen3-235B-A22B")
    m = plan_memory(g, Box(16 * GiB, 0))
    assert m.runnable
    assert any(n.code == "tiers_below_token" and "disk-bound" in n.text for n in m.notes)


def test_tiny_vram_is_left_out() -> None:
    g = like("Mixtral-8x7B")                           # 109 MiB extents
    m = plan_memory(g, Box(64 * GiB, GiB))
    assert not m.placement.gpu and m.vram is None
    assert any(n.code == "vram_too_small" for n in m.notes)


def test_tiers_never_exceed_the_experts() -> None:
    g = like("Qwen3-30B-A3B")
    m = plan_memory(g, Box(256 * GiB, 80 * GiB))
    v, r = m.tier_slots
    assert v + r == g.n_decode_experts
    assert any(n.code == "all_experts_fit" for n in m.notes)


@pytest.mark.parametrize("field, value", [("ram", 0), ("vram", -1), ("ctx", 0), ("kv_type", "x"),
                                          ("pinned_cap", 0.0), ("headroom", 64 * GiB)])
def test_box_rejects_bad_values(field: str, value) -> None:
    kw = dict(ram=32 * GiB, vram=0)
    kw[field] = value
    with pytest.raises(UsageError):
        Box(**kw)


# --- the prediction ------------------------------------------------------------------------------

def test_prediction_arithmetic() -> None:
    g = like("GLM-4.5-Air")
    box = Box(32 * GiB, 24 * GiB)
    mem = plan_memory(g, box)
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
    compute = sum(x.fast_s for x in pr.terms if x.name not in ("storage", "pcie"))
    assert pr.fast_s == pytest.approx(max(compute, t["storage"].fast_s, t["pcie"].fast_s))
    assert pr.tok_s_low == pytest.approx(1 / pr.slow_s) and pr.tok_s_low < pr.tok_s_high
    assert pr.dominant_slow == "storage"
    # every term is slower (or equal) at the slow end
    assert all(x.slow_s >= x.fast_s for x in pr.terms)


def test_cpu_run_has_no_pcie_term_and_is_cpu_bound() -> None:
    g = like("Qwen3-30B-A3B")
    p = plan_for(g, Box(64 * GiB, 0))
    names = [t.name for t in p.prediction.terms]
    assert "pcie" not in names
    assert any(n.code == "cpu_bound" for n in p.notes)


@pytest.mark.parametrize("vram", [0, 24])
def test_more_ram_never_predicts_fewer_tokens(vram: int) -> None:
    g = like("GLM-4.5-Air")
    replays = {s: synthetic_replay(g, s, tokens=48) for s in ("diffuse", "mixed")}
    prev = (0.0, 0.0)
    seen = 0
    for ram in (12, 16, 24, 32, 48, 64, 96, 128):
        p = plan_for(g, Box(ram * GiB, vram * GiB), replays=replays)
        if p.prediction is None:
            assert p.exit_code == 1 and seen == 0      # only the smallest boxes cannot run
            continue
        seen += 1
        lo, hi = p.prediction.tok_s_low, p.prediction.tok_s_high
        assert lo >= prev[0] - 1e-12 and hi >= prev[1] - 1e-12, (ram, lo, hi, prev)
        prev = (lo, hi)
    assert seen >= 6


def test_more_vram_never_predicts_fewer_tokens() -> None:
    g = like("Qwen3-235B-A22B")
    replays = {s: synthetic_replay(g, s, tokens=24) for s in ("diffuse", "mixed")}
    prev = (0.0, 0.0)
    for vram in (0, 8, 16, 24, 48):
        p = plan_for(g, Box(32 * GiB, vram * GiB), replays=replays)
        lo, hi = p.prediction.tok_s_low, p.prediction.tok_s_high
        assert lo >= prev[0] - 1e-12 and hi >= prev[1] - 1e-12, (vram, lo, hi, prev)
        prev = (lo, hi)


def test_json_schema() -> None:
    p = plan_for(like("GLM-4.5-Air"), Box(32 * GiB, 24 * GiB, label="test"))
    d = json.loads(json.dumps(plan_to_dict(p)))
    assert d["schema"] == "expertfs.plan/1" and d["status"] == "fits" and d["exit_code"] == 0
    assert set(d) >= {"model", "box", "placement", "budget", "rates", "routing", "prediction",
                      "notes", "assumptions", "measurements"}
    assert set(d["placement"]) == {"gpu", "trunk", "experts", "pinned"}
    for pool in ("ram", "vram"):
        b = d["budget"][pool]
        assert b["fixed_bytes"] + b["tier_bytes"] + b["unused_bytes"] == b["total_bytes"]
        assert all(set(i) == {"name", "bytes", "note"} for i in b["items"])
        assert b["tier_bytes"] == b["tier_experts"] * d["budget"]["slot_bytes"]
    pr = d["prediction"]
    assert pr["tok_s_low"] <= pr["tok_s_high"]
    assert set(pr["terms"]) == {"storage", "pcie", "experts", "trunk", "attention", "dispatch"}
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
    return geometry_from_synth(SynthConfig.tiny("glm4moe", n_layer=4, n_expert=16, n_expert_used=4))


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
