"""``plan``'s first token (``plan.prefill``): the prompt's compute at the batch's arithmetic
and its unpacking, the cold tiers' reads, the two ends combined as the module says."""

from __future__ import annotations

import math

import pytest

from expertfs.cli.plan import geometry_from_like
from expertfs.runtime.plan.prefill import WidePath, first_token, gemm_rate, touched_per_layer
from expertfs.runtime.plan.rates import Range
from expertfs.runtime.plan.routing import synthetic_replay

from test_plan import rates_for  # noqa: I001 - the sibling test module's helper

GEMM = Range(40.0, 80.0, "test")


@pytest.fixture(scope="module")
def g():
    return geometry_from_like("Qwen3-30B-A3B")


def test_touched_experts_uniform_and_from_a_replay(g):
    E, k = g.n_experts, g.k
    assert touched_per_layer(g, 1) == pytest.approx(k)
    assert touched_per_layer(g, 49) == pytest.approx(E * (1 - (1 - k / E) ** 49))
    assert touched_per_layer(g, 100000) == pytest.approx(E)
    rp = synthetic_replay(g, "mixed", tokens=64)
    few, many = touched_per_layer(g, 8, rp), touched_per_layer(g, 64, rp)
    assert k <= few < many <= E
    assert many <= touched_per_layer(g, 64) + 1e-9           # routes repeat: at most uniform
    # past the replay's end, scaled by the uniform growth
    assert touched_per_layer(g, 128, rp) == pytest.approx(
        many * touched_per_layer(g, 128) / touched_per_layer(g, 64))


def test_first_token_combines_compute_and_reads_as_stated(g):
    rates = rates_for(g)
    ft = first_token(g, rates, 0, 49, GEMM)                   # no replay: uniform at both ends
    n_moe, ext = len(g.moe_layers), sum(g.extent_bytes) / len(g.moe_layers)
    assert ft.read_bytes[0] == pytest.approx(n_moe * touched_per_layer(g, 49) * ext)
    assert ft.s_slow == pytest.approx(ft.compute_s[0] + ft.read_bytes[0] / (rates.storage.slow * 1e9))
    # fast: a layer's experts computed as their reads land, its attention and trunk after
    e, r = ft.experts_s[1], ft.read_bytes[1] / (rates.storage.fast * 1e9)
    assert 0 < e < ft.compute_s[1] and ft.s_fast == pytest.approx(ft.compute_s[1] - e + max(e, r))
    assert ft.s_fast >= max(ft.compute_s[1], r)
    assert ft.s_slow >= ft.s_fast > 0 and ft.compute_s[0] >= ft.compute_s[1]
    # the batch's arithmetic at the matmul rate: twice the rate, less compute; longer, more
    quick = first_token(g, rates, 0, 49, Range(80.0, 160.0, "test"))
    assert quick.compute_s[0] < ft.compute_s[0]
    assert first_token(g, rates, 0, 490, GEMM).compute_s[0] > 2 * ft.compute_s[0]   # 2 batches


def test_an_evicted_trunk_is_read_again_by_every_batch(g):
    """Under a cap that evicts part of the trunk each prompt batch re-reads its share."""
    rates = rates_for(g)
    base = first_token(g, rates, 0, 490, GEMM)               # 2 batches of 256 and 234
    ft = first_token(g, rates, 0, 490, GEMM, trunk_reread=(3 << 20, 1 << 20))
    assert ft.read_bytes[0] == pytest.approx(base.read_bytes[0] + 2 * (3 << 20))
    assert ft.read_bytes[1] == pytest.approx(base.read_bytes[1] + 2 * (1 << 20))
    assert ft.s_slow > base.s_slow and ft.compute_s == base.compute_s


def test_a_measured_routing_sets_the_slow_ends_reads_too(g):
    """With this store's routing known (a trace, the learned usage) the slow end reads what it
    touches, not a balanced model's most; compute and reads still add up there."""
    rates = rates_for(g)
    rp = synthetic_replay(g, "mixed", tokens=64)
    ft = first_token(g, rates, 0, 49, GEMM, rp, slow_replay=rp)
    n_moe, ext = len(g.moe_layers), sum(g.extent_bytes) / len(g.moe_layers)
    assert ft.read_bytes[0] == pytest.approx(n_moe * touched_per_layer(g, 49, rp) * ext)
    assert ft.read_bytes[0] == pytest.approx(ft.read_bytes[1])
    assert ft.read_bytes[0] < first_token(g, rates, 0, 49, GEMM, rp).read_bytes[0]
    assert ft.s_slow == pytest.approx(ft.compute_s[0] + ft.read_bytes[0] / (rates.storage.slow * 1e9))


def test_the_stores_prompts_learned_coverage_sets_both_ends(g):
    """Counters of earlier prompts (``UsageRecorder.prompt_begin``/``prompt_end``) become an
    effective expert count whose uniform routing touches what they touched; the first token
    reads that many experts a batch at both ends, over the replays. Uniform prompts learn the
    whole layer; none before a whole prompt was counted at every MoE layer."""
    from expertfs.runtime.cache.usage import UsageRecorder
    from expertfs.runtime.plan.routing import learned_coverage

    E, k, n_moe = g.n_experts, g.k, len(g.moe_layers)
    rec = UsageRecorder(k=k)
    rec.prompt_begin()
    for layer in g.moe_layers:                      # two batches: the distinct union counts
        rec.add(layer, range(0, 20))
        rec.add(layer, range(10, 30))
    rec.prompt_end(67)
    d = rec.take()[1]
    assert (d["prompt_layers"], d["prompt_tokens"], d["prompt_experts"]) == (n_moe, 67 * n_moe,
                                                                              30 * n_moe)
    cov = learned_coverage(g, d)
    assert cov.k == k and cov.tokens == pytest.approx(67) and k < cov.effective < 31
    assert cov.touched(67) == pytest.approx(30, abs=0.01) and cov.touched(10_000) < 31
    assert "touched 30 of 128 experts" in cov.describe(E)
    assert learned_coverage(g, {**d, "prompt_layers": n_moe - 1}) is None
    wide = {"prompt_layers": n_moe, "prompt_tokens": 67 * n_moe,
            "prompt_experts": round(touched_per_layer(g, 67) + 1) * n_moe}
    assert learned_coverage(g, wide).effective == E       # at least uniform's: the whole layer
    rates, rp = rates_for(g), synthetic_replay(g, "mixed", tokens=64)
    ft = first_token(g, rates, 0, 67, GEMM, rp, slow_replay=rp, coverage=cov)
    ext = sum(g.extent_bytes) / n_moe
    assert ft.read_bytes[0] == ft.read_bytes[1] == pytest.approx(n_moe * cov.touched(67) * ext)
    assert ft.read_bytes[1] < first_token(g, rates, 0, 67, GEMM, rp).read_bytes[1]
    assert ft.cover == cov.describe(E)
    rec.add(g.moe_layers[0], [1])                    # decode after the prompt: not counted
    assert rec.take()[1]["prompt_layers"] == 0


def test_a_tier_that_keeps_the_prompts_experts_reads_them_once(g):
    rates = rates_for(g)
    one = first_token(g, rates, 0, 256, GEMM).read_bytes[0]
    assert first_token(g, rates, 0, 1024, GEMM).read_bytes[0] == pytest.approx(4 * one)
    assert first_token(g, rates, g.n_decode_experts, 1024, GEMM).read_bytes[0] == pytest.approx(one)


def test_both_ends_pay_for_faulting_in_the_tiers_fresh_pages(g):
    """Bytes read into the tiers' fresh pages, up to the tiers' size, cost the read CPU of
    fresh memory on top of the compute, at either end."""
    from dataclasses import replace
    rates = replace(rates_for(g), read_cpu=Range(2.0, 1.5, "t"))
    none = first_token(g, rates, 0, 64, GEMM)
    ext = sum(g.extent_bytes) / len(g.moe_layers)
    small, big = 3, g.n_decode_experts
    for slots in (small, big):
        ft = first_token(g, rates, slots, 64, GEMM)
        fresh = (min(ft.read_bytes[0], slots * ext) / 1e9 * 2.0,
                 min(ft.read_bytes[1], slots * ext) / 1e9 * 1.5)
        assert ft.fresh_s == pytest.approx(fresh) and min(fresh) > 0
        assert ft.s_slow == pytest.approx(ft.compute_s[0] + fresh[0] + ft.read_bytes[0]
                                          / (rates.storage.slow * 1e9))
        e, r = ft.experts_s[1], ft.read_bytes[1] / (rates.storage.fast * 1e9)
        assert ft.s_fast == pytest.approx(ft.compute_s[1] + fresh[1] - e + max(e, r))
    assert none.fresh_s == (0.0, 0.0)
    assert first_token(g, rates, big, 64, GEMM).fresh_s[0] > first_token(g, rates, small, 64, GEMM).fresh_s[0]


def test_gemm_rate_measured_or_stated():
    r = gemm_rate(probe=False)
    assert 0 < r.slow < r.fast and r.source.startswith("stated")
    m = gemm_rate(probe=True)
    assert 0 < m.slow < m.fast and math.isfinite(m.fast) and m.source.startswith("measured")


def test_gemm_rate_is_measured_once_per_box(tmp_path, monkeypatch):
    """Measured on the first plan and kept in the box's rate cache; ``--no-probe`` reads the
    cache and measures nothing."""
    from expertfs.runtime.plan import boxcache
    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    assert boxcache.gemm_rate(probe=False).source.startswith("stated")
    first = boxcache.gemm_rate(probe=True)
    assert first.source.startswith("measured now")
    again = boxcache.gemm_rate(probe=False)
    assert (again.slow, again.fast) == (first.slow, first.fast)
    assert again.source.startswith("measured earlier on this machine (cached)")


def test_a_batch_past_a_types_native_limit_is_dequantized_whole(g):
    """Past a type's native token limit, without a panel product, a trunk product dequantizes
    its matrix (at the measured rate) before BLAS multiplies it, as ``run``'s wide path does; up
    to it, the native kernels' rate. The arithmetic is the same either way."""
    from expertfs.runtime.plan.native import compute_cost
    rates = rates_for(g)
    head = next(m for m in g.trunk_matrices if m.rows == g.n_vocab)
    body = [m for m in g.trunk_matrices if m is not head]
    types = {m.ggml_type for m in body}
    slow = Range(0.5, 1.0, "t")
    wide = {t: WidePath(48, dequant=slow) for t in types}
    native = first_token(g, rates, 0, 48, GEMM, wide=wide).compute_s
    assert native == first_token(g, rates, 0, 48, GEMM).compute_s          # within the limit
    past = first_token(g, rates, 0, 49, GEMM, wide=wide).compute_s
    plain = first_token(g, rates, 0, 49, GEMM).compute_s
    for i, end in enumerate(("slow", "fast")):
        extra = (sum(m.count * m.elements for m in body) / (slow.at(end) * 1e9)
                 - compute_cost(rates.cpu, body, end, quantized=True))
        assert past[i] == pytest.approx(plain[i] + extra)


def test_a_batch_past_a_types_native_limit_takes_the_panel_product(g):
    """Where the kernels have a panel product, a trunk product past the native limit costs its
    arithmetic at the panel product's measured rate, dequantization included (nothing else for
    that matrix); the routed experts and the head are priced as before."""
    rates = rates_for(g)
    head = next(m for m in g.trunk_matrices if m.rows == g.n_vocab)
    body = [m for m in g.trunk_matrices if m is not head]
    panel = Range(20.0, 30.0, "t")
    wide = {m.ggml_type: WidePath(48, panel=panel, dequant=Range(0.5, 1.0, "t")) for m in body}
    past = first_token(g, rates, 0, 49, GEMM, wide=wide).compute_s
    native_only = {t: WidePath(10**6) for t in wide}                     # a limit never passed
    plain = first_token(g, rates, 0, 49, GEMM, wide=native_only).compute_s
    assert plain == first_token(g, rates, 0, 49, GEMM).compute_s
    from expertfs.runtime.plan.native import compute_cost
    for i, end in enumerate(("slow", "fast")):
        el = sum(m.count * m.elements for m in body)
        as_native = compute_cost(rates.cpu, body, end, quantized=True) + 2 * 49 * el / (GEMM.at(end) * 1e9)
        assert past[i] == pytest.approx(plain[i] - as_native + 2 * 49 * el / (panel.at(end) * 1e9))


def test_dequant_rates_are_measured_once_per_box(tmp_path, monkeypatch):
    from expertfs.runtime.plan import boxcache
    from expertfs.runtime.plan.native import _native_types, wide_limits
    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    if "Q4_K" not in _native_types():
        pytest.skip("no native kernels on this machine")
    assert boxcache.dequant_rates(["Q4_K"], probe=False) == {}
    got = boxcache.dequant_rates(["Q4_K", "F32"], probe=True)
    assert set(got) == {"Q4_K"} and 0 < got["Q4_K"].slow <= got["Q4_K"].fast
    again = boxcache.dequant_rates(["Q4_K"], probe=False)["Q4_K"]
    assert (again.slow, again.fast) == (got["Q4_K"].slow, got["Q4_K"].fast)
    assert again.source.startswith("measured earlier on this machine (cached)")
    from expertfs.formats.ggml import GGMLType
    from expertfs.runtime import kernels
    assert wide_limits(["Q4_K"])["Q4_K"] == kernels.max_tokens(GGMLType.Q4_K, 32)


def test_panel_rates_are_measured_once_per_box(tmp_path, monkeypatch):
    """The panel product's GFLOP/s per type, measured on the kernels ``run`` calls past a type's
    native limit, cached per machine like the other rates; none where it does not apply."""
    from expertfs.runtime.plan import boxcache
    from expertfs.runtime.plan.native import _native_types
    monkeypatch.setenv("EXPERTFS_PLAN_CACHE", str(tmp_path / "rates.json"))
    if "Q6_K" not in _native_types():
        pytest.skip("no native kernels on this machine")
    from expertfs.formats.ggml import GGMLType
    from expertfs.runtime import kernels
    import torch
    if kernels.qgemm(torch.zeros(2, 256), torch.zeros(210, dtype=torch.uint8), GGMLType.Q6_K,
                     (1, 256)) is None:
        pytest.skip("the kernels have no panel product under this ISA")
    assert boxcache.panel_rates(["Q6_K"], probe=False) == {}
    got = boxcache.panel_rates(["Q6_K", "F32"], probe=True)
    assert set(got) == {"Q6_K"} and 0 < got["Q6_K"].slow <= got["Q6_K"].fast
    assert "kernels.qgemm" in got["Q6_K"].source
    again = boxcache.panel_rates(["Q6_K"], probe=False)["Q6_K"]
    assert (again.slow, again.fast) == (got["Q6_K"].slow, got["Q6_K"].fast)
    assert again.source.startswith("measured earlier on this machine (cached)")
