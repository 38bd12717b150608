"""The history predictor on synthetic routing traces: it learns what each kind of locality
offers (reuse across tokens, paths across layers, hot experts), does as well as its best
component, and cannot invent locality where there is none. Pure: no store, no I/O."""

from __future__ import annotations

import numpy as np
import pytest

from expertfs.errors import UsageError
from expertfs.runtime.eval.prefetch import evaluate_predictor
from expertfs.runtime.prefetch import COMPONENTS, HistoryPredictor
from expertfs.runtime.trace.synth import PRESETS, SyntheticSpec, synthetic_chunks, synthetic_header

L, E, K, TOKENS, SKIP = 6, 48, 6, 300, 60


def spec(**kw) -> SyntheticSpec:
    return SyntheticSpec(n_layers=L, n_experts=E, k=K, n_tokens=TOKENS, **kw)


def score(s: SyntheticSpec, predictor=None, budget=None):
    p = predictor or HistoryPredictor(L, E)
    return p, evaluate_predictor(p, synthetic_header(s), synthetic_chunks(s), budget=budget,
                                 skip_tokens=SKIP)


class OneComponent:
    """The predictor restricted to one of its estimates (a baseline)."""

    def __init__(self, i: int) -> None:
        self.h, self.i = HistoryPredictor(L, E), i

    def observe(self, layer, experts):
        self.h.observe(layer, experts)

    def predict(self, layer, budget):
        c = self.h.components(layer)[self.i]
        nz = np.flatnonzero(c)
        return nz[np.argsort(-c[nz], kind="stable")][:budget].tolist()


@pytest.mark.parametrize("preset", ["sticky", "hot", "mixed"])
def test_as_good_as_its_best_component_and_far_above_chance(preset):
    s = spec(**PRESETS[preset])
    _, mix = score(s)
    best = max(score(s, OneComponent(i))[1].score.recall for i in range(len(COMPONENTS)))
    assert mix.score.recall >= 0.97 * best
    assert mix.score.recall > 3 * K / E
    assert mix.rows == (TOKENS - SKIP) * L
    assert mix.score.precision == pytest.approx(mix.score.recall)     # k predictions for k experts


def test_uniform_routing_has_nothing_to_learn():
    _, s = score(spec(**PRESETS["uniform"]))
    assert 0.5 * K / E < s.score.recall < 1.6 * K / E


def test_weights_follow_the_kind_of_locality():
    sticky, _ = score(spec(zipf=0.0, stickiness=0.8))
    assert max(sticky.weights, key=sticky.weights.get) == "recency"
    paths, s = score(spec(zipf=0.0, stickiness=0.0, cross_layer=0.9))
    assert max(paths.weights, key=paths.weights.get) == "transition"
    assert s.score.recall > 3 * K / E
    hot, _ = score(spec(zipf=2.0, stickiness=0.0))
    assert hot.weights["frequency"] > hot.weights["recency"]


def test_larger_budget_recalls_more():
    s = spec(**PRESETS["hot"])
    _, at_k = score(s)
    _, at_2k = score(s, budget=2 * K)
    assert at_2k.score.recall > at_k.score.recall
    assert at_2k.score.predicted == 2 * at_k.score.predicted


def test_deterministic():
    s = spec(**PRESETS["drift"])
    a, b = score(s)[1], score(s)[1]
    assert (a.score, a.per_layer) == (b.score, b.per_layer)


def test_edges():
    p = HistoryPredictor(2, 8)
    assert p.predict(0, 4) == []                      # nothing seen yet
    p.observe(0, [])
    assert p.predict(1, 4) == []
    p.observe(0, [1, 2])
    p.observe(1, [3, 4])
    p.observe(0, [1, 5])                              # token 2: transitions 1→0 learnt
    got = p.predict(1, 3)
    assert set(got) <= {3, 4} | {1, 2, 5} and 3 in got and 4 in got
    assert p.predict(1, 100) == p.predict(1, 100)[:8]
    with pytest.raises(UsageError):
        HistoryPredictor(0, 8)
    with pytest.raises(UsageError):
        HistoryPredictor(2, 8, half_life=0)


def test_decay_forgets_an_old_phase():
    p = HistoryPredictor(1, 8, half_life=4.0)
    for _ in range(50):
        p.observe(0, [0, 1])
    for _ in range(30):
        p.observe(0, [6, 7])
    f = p.components(0)[2]
    assert f[6] > 100 * f[0]
