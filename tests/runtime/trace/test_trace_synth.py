"""Synthetic routing traces: deterministic, and each knob moves the statistic it names."""

from __future__ import annotations

import numpy as np
import pytest

from expertfs.errors import UsageError
from expertfs.runtime.trace.file import read_trace
from expertfs.runtime.trace.synth import (PRESETS, SyntheticSpec, parse_spec, synthetic_chunks,
                                          synthetic_header, write_synthetic)


def _routes(spec: SyntheticSpec) -> np.ndarray:
    """[T, L, k] expert ids."""
    ex = np.concatenate([c.experts for c in synthetic_chunks(spec, tokens_per_chunk=64)])
    return ex.reshape(spec.n_tokens, spec.n_layers, spec.k).astype(np.int64)


def _reuse(r: np.ndarray) -> float:
    """Mean share of a route's experts that the previous token used at the same layer."""
    T, L, k = r.shape
    same = (r[1:, :, :, None] == r[:-1, :, None, :]).any(-1)
    return float(same.mean())


def _top_share(r: np.ndarray, layer: int, n: int) -> float:
    c = np.bincount(r[:, layer].ravel())
    return float(np.sort(c)[::-1][:n].sum() / c.sum())


SMALL = dict(n_layers=4, n_experts=32, k=4, n_tokens=600)


def test_deterministic_and_seeded() -> None:
    s = SyntheticSpec(**SMALL, seed=3)
    a, b = _routes(s), _routes(s)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, _routes(SyntheticSpec(**SMALL, seed=4)))


def test_routes_are_valid() -> None:
    s = SyntheticSpec(**SMALL, zipf=1.2, stickiness=0.7, cross_layer=0.5, n_draft=2)
    for c in synthetic_chunks(s, tokens_per_chunk=100):
        assert c.experts.max() < s.n_experts
        assert (np.diff(np.sort(c.experts, axis=1), axis=1) > 0).all()    # distinct
        assert (np.diff(np.sort(c.draft_experts, axis=2), axis=2) > 0).all()
        w = c.weights.astype(np.float32)
        assert np.allclose(w.sum(1), 1, atol=1e-2) and (np.diff(w, axis=1) <= 0).all()
        assert set(np.unique(c.layers)) == set(range(s.n_layers))


@pytest.mark.parametrize("stickiness", [0.0, 0.5, 0.9])
def test_stickiness_sets_token_to_token_reuse(stickiness: float) -> None:
    r = _routes(SyntheticSpec(**SMALL, zipf=0.0, stickiness=stickiness))
    chance = 4 / 32                                        # k / n_experts for fresh picks
    expected = stickiness + (1 - stickiness) * chance
    assert abs(_reuse(r) - expected) < 0.05


def test_zipf_sets_skew_with_per_layer_hot_sets() -> None:
    flat = _routes(SyntheticSpec(**SMALL, zipf=0.0, stickiness=0.0))
    hot = _routes(SyntheticSpec(**SMALL, zipf=1.5, stickiness=0.0))
    assert _top_share(flat, 0, 4) < 0.2 < 0.45 < _top_share(hot, 0, 4)
    tops = [set(np.argsort(np.bincount(hot[:, la].ravel(), minlength=32))[-4:]) for la in range(4)]
    assert len(set(map(frozenset, tops))) > 1              # layers have their own hot experts
    other_run = _routes(SyntheticSpec(**SMALL, zipf=1.5, stickiness=0.0, seed=9))
    assert set(np.argsort(np.bincount(other_run[:, 0].ravel(), minlength=32))[-4:]) == tops[0]


def test_zipf_spread_makes_layers_differ() -> None:
    r = _routes(SyntheticSpec(**SMALL, zipf=1.0, zipf_spread=0.9, stickiness=0.0))
    assert _top_share(r, 0, 4) + 0.2 < _top_share(r, 3, 4)


def test_cross_layer_correlation_makes_paths() -> None:
    def predictability(rho: float) -> float:
        r = _routes(SyntheticSpec(**SMALL, zipf=0.0, stickiness=0.0, cross_layer=rho))
        # how often the most common successor of (layer 0 expert) appears at layer 1
        hits = total = 0
        for e in range(32):
            rows = (r[:, 0] == e).any(1)
            if rows.sum() < 5:
                continue
            nxt = np.bincount(r[rows, 1].ravel(), minlength=32)
            hits += nxt.max()
            total += rows.sum()
        return hits / total

    assert predictability(0.8) > predictability(0.0) + 0.2


def test_phases_move_the_hot_set() -> None:
    s = SyntheticSpec(**{**SMALL, "n_tokens": 800}, zipf=1.5, stickiness=0.0, phase_tokens=400)
    r = _routes(s)
    a = set(np.argsort(np.bincount(r[:400, 0].ravel(), minlength=32))[-3:])
    b = set(np.argsort(np.bincount(r[400:, 0].ravel(), minlength=32))[-3:])
    assert a != b


def test_draft_overlap() -> None:
    s = SyntheticSpec(**SMALL, zipf=0.0, stickiness=0.0, n_draft=1, draft_overlap=0.6)
    c = next(synthetic_chunks(s, tokens_per_chunk=500))
    share = (c.draft_experts[:, 0, :, None] == c.experts[:, None, :]).any(-1).mean()
    assert abs(share - (0.6 + 0.4 * 4 / 32)) < 0.05


def test_write_and_read_back(tmp_path) -> None:
    s = parse_spec("hot,n_layers=3,n_experts=16,k=2,n_tokens=50,expert_bytes=1000")
    h = write_synthetic(tmp_path / "s.eftrace", s)
    h2, c = read_trace(tmp_path / "s.eftrace")
    assert h2 == h == synthetic_header(s)
    assert h.meta["spec"]["zipf"] == PRESETS["hot"]["zipf"]
    assert len(c) == 150 and h.expert_bytes == (1000, 1000, 1000)


def test_parse_spec_errors() -> None:
    assert parse_spec("sticky,k=2").stickiness == PRESETS["sticky"]["stickiness"]
    assert parse_spec("zipf=0.5,n-tokens=10").n_tokens == 10
    for bad, match in [("nope", "preset"), ("k=2,hot", "preset"), ("zz=1", "field"),
                       ("k=x", "number"), ("stickiness=2", "probability"), ("k=99", "geometry"),
                       ("zipf=-1", "zipf"), ("zipf_spread=2", "spread")]:
        with pytest.raises(UsageError, match=match):
            parse_spec(bad)


def test_popularity_replaces_the_zipf_ranks() -> None:
    """Fresh picks drawn in proportion to a given per-layer popularity (a store's learned
    usage); a popularity of the wrong shape or with a zero weight is refused."""
    s = SyntheticSpec(n_layers=2, n_experts=32, k=2, n_tokens=200, stickiness=0.0)
    pop = np.ones((2, 32))
    pop[0, [3, 7]] = 1e6
    pop[1, [30, 31]] = 1e6
    chunks = list(synthetic_chunks(s, popularity=pop))
    ex = np.concatenate([c.experts for c in chunks])
    layers = np.concatenate([c.layers for c in chunks])
    assert set(ex[layers == 0].ravel()) == {3, 7} and set(ex[layers == 1].ravel()) == {30, 31}
    for bad in (np.ones((3, 32)), np.zeros((2, 32))):
        with pytest.raises(UsageError):
            list(synthetic_chunks(s, popularity=bad))


def test_the_decode_after_a_prompt_keeps_and_reuses_as_told() -> None:
    """From ``decode_after`` on the stickiness is ``decode_stickiness`` and a share ``reuse``
    of the other picks goes to experts the run routed to before; the prompt before it keeps
    the spec's own dynamics, so its routes are as without the decode fields."""
    base = dict(SMALL, n_experts=256, zipf=0.0, stickiness=0.1, n_tokens=400)
    plain = _routes(SyntheticSpec(**base))
    r = _routes(SyntheticSpec(**base, decode_after=40, decode_stickiness=0.6, reuse=0.9))
    assert np.array_equal(r[:40], plain[:40])
    dec = r[40:]
    assert 0.6 < _reuse(dec) < 0.8        # kept, or the same expert reused again

    def reused(x: np.ndarray) -> float:
        """The share of the decode's picks the run had routed to before at that layer."""
        hit = n = 0
        for la in range(x.shape[1]):
            seen = set(x[:40, la].ravel())
            for t in range(40, 100):
                hit += sum(int(e) in seen for e in x[t, la])
                n += len(x[t, la])
                seen.update(int(e) for e in x[t, la])
        return hit / n
    assert reused(r) > 0.95 and reused(r) > reused(plain) + 0.1
    with pytest.raises(UsageError, match="decode_stickiness"):
        SyntheticSpec(**SMALL, decode_stickiness=1.5)
    with pytest.raises(UsageError, match="reuse"):
        SyntheticSpec(**SMALL, reuse=2.0)
