"""The first reads of a run into its empty tiers (``plan.coldstart``) and how ``predict``
counts them: pure arithmetic on given rates and routing."""

from __future__ import annotations

import pytest

from expertfs.cli.plan import geometry_from_like
from expertfs.errors import UsageError
from expertfs.runtime.plan import boxcache
from expertfs.runtime.plan.assumptions import GiB
from expertfs.runtime.plan.budget import Box, layout
from expertfs.runtime.plan.coldstart import (WARM_SHARE, distinct_experts, first_read_bytes,
                                             first_read_seconds, start_terms, warm_read_bytes)
from expertfs.runtime.plan.rates import read_cpu_from, stated_read_cpu, storage_from_profile
from expertfs.runtime.plan.predict import (Range, Rates, Routing, RoutingRange, predict,
                                           stated_cpu, stated_gpu, stated_pcie)

_G = {}


def qwen():
    if "q" not in _G:
        _G["q"] = geometry_from_like("Qwen3-30B-A3B")
    return _G["q"]


def test_distinct_experts_by_hand() -> None:
    assert distinct_experts(128, 8, 1) == pytest.approx(8)
    assert distinct_experts(128, 8, 2) == pytest.approx(8 + 8 * (1 - 8 / 128))
    assert distinct_experts(128, 8, 48) == pytest.approx(128 * (1 - (120 / 128) ** 48))
    assert distinct_experts(128, 8, 10_000) == pytest.approx(128)
    assert distinct_experts(16, 16, 3) == pytest.approx(16)
    assert distinct_experts(128, 8, 0) == 0.0


def test_first_read_bytes_scale_with_hits_and_stop_at_the_tiers() -> None:
    g = qwen()
    touched = distinct_experts(g.n_experts, g.k, 48) * sum(g.extent_bytes)
    big = 10 ** 15
    assert first_read_bytes(g, 1.0, 48, big) == pytest.approx(touched)
    assert first_read_bytes(g, 0.25, 48, big) == pytest.approx(0.25 * touched)
    assert first_read_bytes(g, 0.0, 48, big) == 0.0                 # misses are read anyway
    assert first_read_bytes(g, 1.0, 48, GiB) == GiB                 # never more than the tiers
    assert first_read_seconds(2e9, 100, 1.0) == pytest.approx(0.02)
    assert first_read_seconds(0.0, 100, 1.0) == 0.0


def test_a_prompt_loads_its_experts_before_the_decode_reads_new_ones() -> None:
    """After P prompt tokens the decode's n tokens read only what P + n tokens touch beyond what
    P touched; a prompt that touched every expert leaves nothing to read."""
    g = qwen()
    every = g.n_experts * sum(g.extent_bytes)
    big = 10 ** 15

    def frac(n: int) -> float:
        return distinct_experts(g.n_experts, g.k, n) / g.n_experts

    assert first_read_bytes(g, 1.0, 16, big, 64) == pytest.approx((frac(80) - frac(64)) * every)
    assert first_read_bytes(g, 1.0, 16, big, 64) < first_read_bytes(g, 1.0, 16, big) / 50
    assert first_read_bytes(g, 1.0, 16, big, 0) == pytest.approx(frac(16) * every)
    assert first_read_bytes(g, 1.0, 64, big, 10_000) == pytest.approx(0.0, abs=1.0)
    # a tier the prompt already filled: its experts are the steady state's, nothing more to read
    small = int(frac(64) * every / 2)
    assert first_read_bytes(g, 1.0, 16, small, 64) == 0.0


def _routing(miss: float, cover: float = 0.0) -> RoutingRange:
    r = Routing("r", True, "wlfu", 100, 0.0, 1 - miss, miss, 0.0, 0.0, 0.0, cover)
    return RoutingRange(r, r)


def test_the_warm_start_reads_what_the_prompt_left_at_its_share_of_the_drive() -> None:
    """The warm start's CPU at the slow end: its bytes a token (what is left of the RAM tier
    after the prompt, spread over the run, at most its share of the drive over the token's
    compute) times the CPU seconds a GB of reads costs; the same at the fast end's rates (the
    decode's cores do those reads: nothing hides them)."""
    g = qwen()
    every = g.n_experts * sum(g.extent_bytes)
    assert warm_read_bytes(g, every, 0.25) == pytest.approx(0.75 * every)
    assert warm_read_bytes(g, every // 4, 0.5) == 0.0               # the prompt filled it
    assert warm_read_bytes(g, 10 * every, 1.0) == 0.0
    args = dict(hits=(1.0, 1.0), tier_bytes=every, ram_tier_bytes=every, prompt_tokens=64,
                storage=Range(1.0, 2.0, "t"), read_cpu=Range(0.5, 0.25, "t"),
                compute_s=(0.1, 0.05))

    def warm(n: int, cover: float) -> tuple[float, float]:
        return next((s, f) for name, s, f, _ in start_terms(g, n_predict=n, prompt_cover=cover,
                                                             **args) if name == "warm_start")

    paced = WARM_SHARE * 1.0 * 0.1                                  # GB a token
    paced_fast = WARM_SHARE * 2.0 * 0.05
    assert warm(16, 0.5) == (pytest.approx(min(0.5 * every / 16 / 1e9, paced) * 0.5),
                             pytest.approx(min(0.5 * every / 16 / 1e9, paced_fast) * 0.25))
    assert warm(100_000, 0.5)[0] < warm(16, 0.5)[0] / 100           # a long run amortises it
    # the cover is never taken above uniform routing's, the most a prompt can touch
    uniform = distinct_experts(g.n_experts, g.k, 64) / g.n_experts
    assert warm(64, 1.0)[0] == pytest.approx((1 - uniform) * every / 64 / 1e9 * 0.5)


def test_the_reads_cpu_comes_from_the_drive_measurement() -> None:
    point = {"backend": "direct", "qd": 8, "gbps": 1.0, "reads": 100, "bytes": 100 * (4 << 20),
             "cpu_us_per_read": 1200.0}
    rng, detail = storage_from_profile({"points": [point]}, 8)
    assert detail["cpu_s_per_gb"] == pytest.approx(1200e-6 / ((4 << 20) / 1e9))
    r = read_cpu_from(detail, "probe")
    assert r.slow == r.fast == pytest.approx(detail["cpu_s_per_gb"]) and "probe" in r.source
    assert read_cpu_from({}, "x") == stated_read_cpu()             # not measured: stated
    del point["cpu_us_per_read"]
    assert storage_from_profile({"points": [point]}, 8)[1]["cpu_s_per_gb"] is None


def test_predict_first_reads_term() -> None:
    g = qwen()
    box = Box(64 * GiB, 0, ctx=512, n_predict=48)
    mem = layout(g, box, "cpu", "quant")
    rates = Rates(Range(1.0, 3.0, "t"), stated_pcie(4), stated_cpu(), stated_gpu(["Q4_K"]))
    pr = predict(g, mem, _routing(0.0), rates, box)
    t = pr.term("first_reads")
    cold = first_read_bytes(g, 1.0, 48, mem.ram.tier_bytes)
    assert t.slow_s == pytest.approx(min(cold / 48 / (1.0 * WARM_SHARE * 1e9),
                                         g.token_expert_bytes / 1e9))    # never worse than misses
    assert t.fast_s == pytest.approx(cold / 48 / 3e9)
    io = ("storage", "first_reads")
    compute = sum(x.fast_s for x in pr.terms if x.name not in io)
    drive = sum(x.fast_s for x in pr.terms if x.name in io)
    assert pr.fast_s == pytest.approx(max(compute, drive))          # one drive, overlapped
    assert pr.slow_s == pytest.approx(sum(x.slow_s for x in pr.terms))
    # a longer run amortises the same reads
    long = predict(g, mem, _routing(0.0), rates, Box(64 * GiB, 0, ctx=512, n_predict=4800))
    assert long.term("first_reads").fast_s < t.fast_s / 30
    assert long.tok_s_low > pr.tok_s_low and long.tok_s_high >= pr.tok_s_high


def test_predict_counts_the_prompts_experts_as_loaded(monkeypatch) -> None:
    """A tier that cannot hold every expert keeps what the prompt read; one that holds every
    expert, with the prompt window asked for (``cache.window``), reads the prompt through its
    spare slots and keeps none."""
    monkeypatch.setenv("EXPERTFS_PROMPT_WINDOW", "1")
    g = qwen()
    rates = Rates(Range(1.0, 3.0, "t"), stated_pcie(4), stated_cpu(), stated_gpu(["Q4_K"]))
    for ram, kept in ((12 * GiB, True), (64 * GiB, False)):
        cold = Box(ram, 0, ctx=512, n_predict=16)
        warm = Box(ram, 0, ctx=512, n_predict=16, prompt_tokens=512)
        mem = layout(g, cold, "cpu", "quant")
        a, b = (predict(g, mem, _routing(0.0, 1.0), rates, box) for box in (cold, warm))
        if kept:
            assert b.term("first_reads").fast_s < a.term("first_reads").fast_s / 100
            assert "after a 512-token prompt" in b.term("first_reads").detail
            assert b.tok_s_low > a.tok_s_low
        else:
            assert b.term("first_reads").fast_s == a.term("first_reads").fast_s > 0
            assert "spare slots" in b.term("first_reads").detail


def test_box_rejects_no_tokens() -> None:
    with pytest.raises(UsageError):
        Box(GiB, 0, n_predict=0)
    with pytest.raises(UsageError):
        Box(GiB, 0, prompt_tokens=-1)


def test_storage_key_separates_read_sizes(tmp_path) -> None:
    p = str(tmp_path)
    assert boxcache.storage_key(p, 100 << 10) != boxcache.storage_key(p, 3 << 20)
    assert boxcache.storage_key(p, 3 << 20) == boxcache.storage_key(p, (3 << 20) + 4096)
    assert boxcache.storage_key(p).startswith("storage|dev ")


def test_a_replay_drawn_from_learned_usage_routes_to_the_used_experts() -> None:
    from expertfs.runtime.plan.routing import usage_replay, usage_tokens

    g = qwen()
    usage = {(layer, e): 1000.0 for layer in g.moe_layers for e in range(g.k)}
    assert usage_tokens(g, usage) == pytest.approx(1000.0)
    rp = usage_replay(g, usage, "diffuse", tokens=32)
    E = g.n_experts
    picks = [key % E for row in rp.rows for key in row]
    assert sum(p < g.k for p in picks) / len(picks) > 0.8            # the prior keeps the rest
    assert len(set(picks)) > g.k                                     # ... a chance


def test_learned_decode_dynamics_lower_the_replays_misses_at_a_small_tier() -> None:
    """The runs' counters become the generator's decode parameters (kept first, then the rest
    reused), each beyond its chance; none below ``MIN_DYNAMICS_TOKENS`` or without the chance
    baseline (``seen``); a replay with the sticky dynamics such runs show misses less at a tier
    smaller than the model than the preset's."""
    from expertfs.runtime.plan.routing import (MIN_DYNAMICS_TOKENS, learned_dynamics, route,
                                               usage_replay)

    g = qwen()
    per_token = g.k * len(g.moe_layers)
    few = {"routes": per_token * (MIN_DYNAMICS_TOKENS - 1), "follows": 1, "kept": 1, "reused": 1,
           "seen": 0, "seen_routes": 1}
    assert learned_dynamics(g, few) is None
    n = per_token * 100
    old = {"routes": n, "follows": n, "kept": n // 2, "reused": n * 9 // 10}
    assert learned_dynamics(g, old) is None                 # no baseline: chance not separable
    d = learned_dynamics(g, {**old, "seen": 0, "seen_routes": n})
    c = g.k / g.n_experts
    assert d.stickiness == pytest.approx((0.5 - c) / (1 - c), abs=0.01)
    assert d.reuse == pytest.approx(0.8)                    # nothing seen: no chance to take off
    assert d.tokens == pytest.approx(100) and "46% of experts kept" in d.describe()
    half = learned_dynamics(g, {**old, "seen": n * g.n_experts // 2, "seen_routes": n})
    chance = (0.5 - c) / (1 - c)                            # half seen, the previous k aside
    assert half.reuse == pytest.approx((0.8 - chance) / (1 - chance), abs=0.02)
    usage = {(layer, e): 10.0 + e for layer in g.moe_layers for e in range(g.n_experts)}
    slots = len(g.moe_layers) * g.n_experts // 4

    def miss(dyn) -> float:
        rp = usage_replay(g, usage, "diffuse", tokens=128, dynamics=dyn)
        return route(g, rp, 0, slots, experts_on_gpu=False, label="t", synthetic=False).miss_rate

    sticky = learned_dynamics(g, {"routes": n, "follows": n, "kept": n * 8 // 10, "reused": n,
                                  "seen": 0, "seen_routes": n})
    assert miss(sticky) < 0.5 * miss(None)


def test_a_random_router_learns_no_reuse_and_a_working_set_does() -> None:
    """Counters recorded by ``UsageRecorder`` from a run that routes at random after a long
    prompt (which saw nearly every expert, so nearly every pick is "reused") learn no
    stickiness or reuse beyond chance, a skewed one none beyond the chance its popularity
    gives; a run whose decode keeps to a working set after a short prompt learns a high reuse."""
    import numpy as np

    from expertfs.runtime.cache.usage import UsageRecorder
    from expertfs.runtime.plan.routing import learned_dynamics

    g = qwen()
    rng = np.random.default_rng(0)

    def counters(pick, prompt_tokens: int) -> dict[str, int]:
        u = UsageRecorder(k=g.k)
        for layer in g.moe_layers:                       # the prompt's union
            u.add(layer, sorted({int(e) for e in rng.choice(g.n_experts, prompt_tokens * g.k)}))
        for _ in range(64):
            for layer in g.moe_layers:
                u.add(layer, pick())
        return u.take()[1]

    def uniform():
        return rng.choice(g.n_experts, g.k, replace=False)

    def working_set():
        return rng.choice(4 * g.k, g.k, replace=False)
    rand = learned_dynamics(g, counters(uniform, 100))
    assert rand.stickiness < 0.05 and rand.reuse < 0.1
    ws = learned_dynamics(g, counters(working_set, 2))
    assert ws.stickiness > 0.1 and ws.reuse > 0.7
    # a skewed router drawing at random: its popular experts are seen first, so its "reuse"
    # is chance under its popularity (the learned usage), not under a uniform one
    pop = 1.0 / np.arange(1, g.n_experts + 1)
    pop /= pop.sum()

    def skewed():
        return rng.choice(g.n_experts, g.k, replace=False, p=pop)
    dyn = counters(skewed, 8)
    usage = {(layer, e): 1000.0 * pop[e] for layer in g.moe_layers for e in range(g.n_experts)}
    assert learned_dynamics(g, dyn).reuse > 0.2
    assert learned_dynamics(g, dyn, usage).reuse < 0.1


def test_no_probe_prices_native_types_at_the_native_kernels_stated_rate(tmp_path, monkeypatch) -> None:
    """With nothing measured or cached, a type the native kernels compute gets their stated
    per-core rate for the kernels' ISA (bounded by the memory bandwidth), not torch
    dequantization's, and the native path's stated work a layer instead of the torch path's
    per expert."""
    from expertfs.runtime.plan.native import (STATED_NATIVE_GWPS, STATED_NATIVE_GWPS_AVX512,
                                              STATED_NATIVE_LAYER_S, _native_types, kernel_info,
                                              stated_native)
    from expertfs.runtime.plan.rates import bytes_per_element

    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    g = qwen()
    mats = [m for layer in g.expert_parts for m in layer]
    rates, detail = boxcache.cpu_rates(g, mats, probe=False)
    native = {m.ggml_type for m in mats} & _native_types()
    if not native:
        pytest.skip("no native kernels on this machine")
    t = sorted(native)[0]
    c = rates.quant_cost(t)
    assert c.gbps.source.startswith("stated default: the native kernels")
    mem = Range(10.0, 20.0, "t")
    got = stated_native([t], mem, cores=2)[t].gbps
    bpe = bytes_per_element(t)
    lo, hi = STATED_NATIVE_GWPS_AVX512 if kernel_info().get("isa") == "avx512" \
        else STATED_NATIVE_GWPS
    assert (got.slow, got.fast) == (min(10.0, lo * 2 * bpe), min(20.0, hi * 2 * bpe))
    assert stated_native(["F32"], mem) == {}                     # floats: torch's products
    assert detail["stated_native"] == sorted(native)
    assert (rates.layer_s.slow, rates.layer_s.fast) == STATED_NATIVE_LAYER_S


def test_cached_cpu_rates_are_measured_anew_when_the_box_speed_moved(tmp_path, monkeypatch) -> None:
    """A CPU entry keeps the speed check it was measured beside; a probing plan runs the check
    again and uses the entry while the box is within ``DRIFT`` of it, else measures anew."""
    from expertfs.runtime.plan import native

    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    assert native.speed_check(0.05) > 0                           # the real check runs here
    g = qwen()
    mats = [m for layer in g.expert_parts for m in layer]
    monkeypatch.setattr(native, "speed_check", lambda *_: 10.0)
    _, first = boxcache.cpu_rates(g, mats, probe=True)
    assert not first["from_cache"] and first["check_gbps"] == 10.0 and "dropped" not in first
    monkeypatch.setattr(native, "speed_check", lambda *_: 11.0)      # within the drift: kept
    _, again = boxcache.cpu_rates(g, mats, probe=True)
    assert again["from_cache"] and again["check_gbps"] == 10.0
    entry = boxcache.load()[boxcache.cpu_key()]
    entry["gemm_gflops"] = {"slow": 1.0, "fast": 2.0, "source": "measured now: t"}
    boxcache.save({boxcache.cpu_key(): entry})
    monkeypatch.setattr(native, "speed_check", lambda *_: 20.0)      # twice as fast: measured anew
    _, moved = boxcache.cpu_rates(g, mats, probe=True)
    assert not moved["from_cache"] and moved["check_gbps"] == 20.0
    assert moved["dropped"] == {"check_gbps_then": 10.0, "check_gbps_now": 20.0}
    assert "gemm_gflops" not in boxcache.load()[boxcache.cpu_key()]   # the whole entry went
    _, offline = boxcache.cpu_rates(g, mats, probe=False)          # --no-probe: no check at all
    assert "check_gbps" not in offline


def test_the_box_speed_checks_of_the_last_day_widen_the_cpu_rates(tmp_path, monkeypatch) -> None:
    """Each probing plan keeps its speed check; the slowest and fastest of the last day against
    the entry's widen the slow and the fast end (rates times, seconds over), within the limit;
    ``--no-probe`` applies the kept spread too."""
    import dataclasses
    import time

    from expertfs.runtime.plan import native
    from expertfs.runtime.plan.rates import LinearCost, stated_cpu

    assert boxcache.spread_of([], 10.0) == (1.0, 1.0)
    now = time.time()
    assert boxcache.spread_of([[now, 8.0], [now, 12.0]], 10.0) == pytest.approx((0.8, 1.2))
    assert boxcache.spread_of([[now, 1.0], [now - 2 * 86400, 100.0]], 10.0) == (0.5, 1.0)
    c = LinearCost(Range(2e-5, 1e-5, "o"), Range(4.0, 6.0, "g"))
    r = boxcache.with_spread(dataclasses.replace(stated_cpu(), fused={"Q4_K": c}), 0.5, 1.5)
    q = r.fused["Q4_K"]
    assert (q.gbps.slow, q.gbps.fast) == pytest.approx((2.0, 9.0))
    assert (q.overhead_s.slow, q.overhead_s.fast) == pytest.approx((4e-5, 1e-5 / 1.5))
    assert "speed checks" in q.gbps.source

    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    g = qwen()
    mats = [m for layer in g.expert_parts for m in layer]
    monkeypatch.setattr(native, "speed_check", lambda *_: 10.0)
    base, d0 = boxcache.cpu_rates(g, mats, probe=True)
    assert d0["spread"] == (1.0, 1.0)
    monkeypatch.setattr(native, "speed_check", lambda *_: 8.5)       # slower, within the drift
    slower, d1 = boxcache.cpu_rates(g, mats, probe=True)
    assert d1["spread"] == pytest.approx((0.85, 1.0)) and d1["from_cache"]
    key = sorted(base.layers)[0]
    assert slower.layers[key].gbps.slow == pytest.approx(0.85 * base.layers[key].gbps.slow)
    assert slower.layers[key].gbps.fast == pytest.approx(base.layers[key].gbps.fast)
    _, offline = boxcache.cpu_rates(g, mats, probe=False)
    assert offline["spread"] == pytest.approx((0.85, 1.0))


def test_a_box_that_slows_while_plan_measures_it_is_measured_again(tmp_path, monkeypatch) -> None:
    """The check runs again after each probe and the entry keeps the slowest: figures taken
    while another process held a core are not kept as the box's own once it is quiet again."""
    from expertfs.runtime.plan import native

    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    g = qwen()
    mats = [m for layer in g.expert_parts for m in layer]
    speeds = iter([20.0] + [10.0] * 10)              # quiet at the first check, busy after
    monkeypatch.setattr(native, "speed_check", lambda *_: next(speeds))
    _, first = boxcache.cpu_rates(g, mats, probe=True)
    assert first["checks_after"] and first["check_gbps"] == 10.0
    assert boxcache.load()[boxcache.cpu_key()]["check_gbps"] == 10.0
    monkeypatch.setattr(native, "speed_check", lambda *_: 20.0)   # quiet again
    _, again = boxcache.cpu_rates(g, mats, probe=True)
    assert again["dropped"] == {"check_gbps_then": 10.0, "check_gbps_now": 20.0}
    assert not again["from_cache"] and again["check_gbps"] == 20.0
    _, cached = boxcache.cpu_rates(g, mats, probe=True)   # nothing measured: no check after
    assert cached["from_cache"] and "checks_after" not in cached


def test_a_usage_replay_routes_each_expert_as_often_as_the_runs_did() -> None:
    """Fresh picks drawn with ``_draw_weights`` include each expert in a token's route at its
    learned share (k x its share of the counts), to a few points; drawn in proportion to the
    counts instead, the expert in 97% of the routes is left out of a quarter of them."""
    import numpy as np

    from expertfs.runtime.plan.routing import _draw_weights
    from expertfs.runtime.trace.synth import SyntheticSpec, synthetic_chunks

    E, k, n = 32, 4, 4000
    pi = np.array([0.97, 0.8, 0.6, 0.4] + [(k - 2.77) / (E - 4)] * (E - 4))   # sums to k
    counts = np.tile(pi * 1000.0, (2, 1))
    spec = SyntheticSpec(n_layers=2, n_experts=E, k=k, n_tokens=n, zipf=0.0, stickiness=0.0)

    def included(weights) -> np.ndarray:
        routes = np.concatenate([c.experts.reshape(-1, 2, k)
                                 for c in synthetic_chunks(spec, popularity=weights)])
        return np.stack([np.bincount(routes[:, i].ravel(), minlength=E) / n for i in range(2)])
    assert np.abs(included(_draw_weights(counts, k)) - pi).max() < 0.05   # an approximation
    assert included(counts)[:, 0].max() < 0.8


def test_a_replay_with_learned_dynamics_follows_no_preset_cross_layer_links() -> None:
    """The presets' cross-layer links are random permutations, not the model's: with the store's
    own decode dynamics the replay drops them; a preset alone keeps its own."""
    from expertfs.runtime.plan.routing import Dynamics, usage_replay
    from expertfs.runtime.trace.synth import PRESETS

    g = qwen()
    usage = {(layer, e): 1.0 + e for layer in g.moe_layers for e in range(g.n_experts)}
    plain = usage_replay(g, usage, "mixed", tokens=8)
    learned = usage_replay(g, usage, "mixed", tokens=8, dynamics=Dynamics(0.4, 0.2, 64.0))
    assert plain.header.meta["spec"]["cross_layer"] == PRESETS["mixed"]["cross_layer"] > 0
    assert learned.header.meta["spec"]["cross_layer"] == 0.0


def test_the_learned_tokens_count_a_prompts_tokens_not_its_union() -> None:
    """Three runs of a 67-token prompt and 16 decoded tokens: their usage holds each prompt's
    union (40 experts a layer) and the decoded routes, 21 tokens a run by the counts, but
    the counters say 83 a run, enough for ``MIN_USAGE_TOKENS``."""
    from expertfs.runtime.plan.routing import MIN_USAGE_TOKENS, usage_tokens

    g = qwen()
    L, k = len(g.moe_layers), g.k
    usage = {(layer, e): 3.0 + (16.0 * 3 if e < k else 0.0)
             for layer in g.moe_layers for e in range(40)}
    counters = {"prompt_tokens": 3 * 67 * L, "prompt_layers": 3 * L, "routes": 3 * 16 * k * L}
    assert usage_tokens(g, usage) < MIN_USAGE_TOKENS <= usage_tokens(g, usage, counters)
    assert usage_tokens(g, usage, counters) == pytest.approx(3 * (67 + 16))
    assert usage_tokens(g, usage, {}) == usage_tokens(g, usage)     # older runs: the counts
