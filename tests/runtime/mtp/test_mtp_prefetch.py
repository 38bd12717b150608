"""Draft-route prefetch and the utility gate: the token route memory, the online calibration,
prefetches for every MoE layer before the verify pass (source "draft") scored against what the
pass routed, output unchanged, and the gate's depth and fetch-threshold decisions."""

from __future__ import annotations

import numpy as np
import pytest

from support.mtp_model import build_model, engine, greedy_plain, one_thread, stats  # noqa: F401

torch = pytest.importorskip("torch")

from expertfs.runtime.generate import generate  # noqa: E402
from expertfs.runtime.mtp.draftroute import TokenRouteMemory  # noqa: E402
from expertfs.runtime.mtp.gate import UtilityGate  # noqa: E402
from expertfs.runtime.sampling import Sampler  # noqa: E402

PROMPT = [5, 100, 200, 37, 400, 12, 7, 300, 255, 1, 2, 3, 5, 100, 200]
N = 20


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("dp"), seed=6)[2]


def test_token_route_memory_counts_the_last_occurrences():
    m = TokenRouteMemory(n_layers=2, n_experts=8, depth=2)
    m.add(7, np.array([[1, 2], [3, 4]]))
    m.add(7, np.array([[1, 5], [3, -1]]))
    m.add(7, np.array([[6, 5], [0, 0]]))                   # the oldest falls out
    c = m.counts([7, 9])
    assert c.shape == (2, 2, 8)
    assert c[0, 0].tolist() == [0, 1, 0, 0, 0, 2, 1, 0]
    assert c[0, 1].tolist() == [1, 0, 0, 1, 0, 0, 0, 0]
    assert c[1].sum() == 0


class Spy:
    """Records prefetch calls with their source around the real provider."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefetch(self, layer, experts, source="gate"):
        self.calls.append((layer, list(experts), source))
        return self.inner.prefetch(layer, experts, source=source)


def test_draft_prefetch_covers_every_layer_and_keeps_the_output(store):
    with engine(store) as (eng, _):
        ref = greedy_plain(eng, PROMPT, N)
    with engine(store, mtp=2, draft_prefetch=True, provider="tiered",
                ram_bytes=4 << 20) as (eng, sp):
        spy = Spy(eng.provider)
        eng.provider = spy
        got = [s.token for s in generate(eng, PROMPT, Sampler(), N, spec=sp.speculator)]
        pf = sp.speculator.draft_prefetcher
        moe = pf.predictor.layers
        d = stats(eng, sp)["mtp"]["draft_prefetch"]
    assert got == ref
    draft_layers = {la for la, _, src in spy.calls if src == "draft"}
    assert draft_layers == set(moe)                        # the whole step, every MoE layer
    assert d["steps"] == sp.speculator.stats.steps - sp.speculator.stats.plain_steps
    assert d["needed"] > 0 and 0.0 <= d["coverage"] <= 1.0 and 0.0 <= d["waste"] <= 1.0
    assert d["provider"]["predicted"] == d["predicted"]    # the provider saw every prediction
    assert pf.predictor.total.sum() > pf.predictor.total.size * 8.0   # calibration learned
    assert len(pf.predictor.memory) > 0


def test_calibration_moves_toward_what_routes():
    class Eng:                                             # the predictor's view of a model
        pass
    from types import SimpleNamespace as NS
    from expertfs.runtime.model.config import GATING_SIGMOID
    from expertfs.runtime.mtp.draftroute import DraftRoutePredictor
    E, D = 8, 4
    g = torch.Generator().manual_seed(0)
    blocks = [NS(layer=i, ffn_norm=torch.ones(D), moe=NS(router=NS(
        weight=torch.randn(E, D, generator=g), probs_bias=None))) for i in (1, 2)]
    eng = Eng()
    eng.config = NS(n_experts=E, n_expert_used=2, rms_eps=1e-6, gating=GATING_SIGMOID)
    eng.trunk = NS(blocks=blocks)
    p = DraftRoutePredictor(eng)
    h = torch.randn(3, D, generator=g)
    before = p.predict(h, [1, 2, 3])
    rb, _ = p.features(h, [1, 2, 3])
    for _ in range(50):                                    # rows always use their top-1 expert
        p.predict(h, [1, 2, 3])
        p.learn(rb == 0)
    after = p.predict(h, [1, 2, 3])
    top = rb[:, 0] == 0
    assert after[0][top.any(0)].min() > before[0][top.any(0)].min()
    assert after[0][~top.any(0)].max() < before[0][~top.any(0)].max()


def test_gate_depth_follows_acceptance_and_cost():
    good = UtilityGate(3, explore=1000)
    for _ in range(60):
        k = good.depth(100)
        good.update(k, k, 0.002 * k, 0.010 + 0.002 * k)    # drafts always right, cheap rows
    assert good.depth(100) >= 2
    bad = UtilityGate(3, explore=1000)
    for _ in range(60):
        k = bad.depth(100)
        bad.update(k, 0, 0.002 * k, 0.010 + 0.008 * k)     # never right
    assert bad.depth(100) == 0
    assert good.depth(1) == 0                              # one token left: nothing to draft


def test_gate_fetch_threshold_follows_the_disk():
    g = UtilityGate(2)
    first = g.fetch_threshold()
    for _ in range(30):
        g.note_stall(0.9, 1.0)                             # waiting on storage most of a step
    busy = g.fetch_threshold()
    for _ in range(60):
        g.note_stall(0.0, 1.0)
    idle = g.fetch_threshold()
    assert 0.1 <= idle < first < busy <= 0.5


def test_offline_evaluations_run_and_are_consistent(store):
    from expertfs.runtime.eval.mtp import acceptance, route_predictors, tail_skip_quality
    from expertfs.runtime.sampling import SamplingParams
    text = (PROMPT * 8)[:40]
    with engine(store, mtp=2, lookahead=True) as (_, sp):
        r = route_predictors(sp, text, segment=40, warm=6, segments=1)
        a = acceptance(sp, [PROMPT], SamplingParams(), 8)
    assert r["steps"] == 40 - 6 - 3
    names = set(r["predictors"])
    assert any(n.startswith("draft (calibrated") for n in names)
    assert any(n.startswith("next-layer lookahead") for n in names)
    assert any(n.startswith("history") for n in names)
    for v in r["predictors"].values():
        assert 0.0 <= v["coverage"] <= 1.0 and 0.0 <= v["waste"] <= 1.0
    assert a["emitted"] == 7 and 0.0 <= a["acceptance"] <= 1.0
    with engine(store) as (ex, _), engine(store, route_tail_skip=4) as (lo, _):   # N >= k: exact
        q = tail_skip_quality(ex, lo, text, segment=20, warm=6, segments=2)
    assert q["positions"] == 28 and q["top1_agreement"] == 1.0 and q["mean_kl"] < 1e-9
