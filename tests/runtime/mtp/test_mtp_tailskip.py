"""``--route-tail-skip N`` (opt-in, lossy): inside a decode/verify window an expert that is not
resident and ranks past N for every token is neither fetched nor computed; the other pairs
keep their weights; prefill is exact; N >= k changes nothing; off by default."""

from __future__ import annotations

import pytest

from support.mtp_model import build_model, engine, one_thread, stats  # noqa: F401

torch = pytest.importorskip("torch")

from expertfs.runtime.model.config import GATING_SOFTMAX  # noqa: E402
from expertfs.runtime.model.router import Router  # noqa: E402
from expertfs.runtime.mtp.routing import RouterHook  # noqa: E402

PROMPT = [5, 100, 200, 37, 400, 12, 7, 300, 255, 1, 2, 3]


class _Cfg:
    gating, norm_w, w_scale, n_expert_used, n_group, n_group_used = GATING_SOFTMAX, True, 0.0, 4, 1, 1


def _hook(n: int, resident: set[int]) -> RouterHook:
    h = RouterHook(Router(_Cfg()), {}, skip_n=n, resident=lambda la, e: e in resident)
    h.layer_of = {}
    return h


def test_window_rule_on_a_three_token_window():
    h = _hook(2, resident={7})
    ids = torch.tensor([[1, 2, 3, 7], [2, 1, 4, 5], [6, 3, 1, 2]])
    wts = torch.tensor([[.4, .3, .2, .1], [.4, .3, .2, .1], [.4, .3, .2, .1]])
    out_i, out_w = h._tail_skip(0, ids, wts)
    # ranks >= 2 everywhere: 4, 5 (not resident) -> skipped; 7 resident -> kept; 3 is rank 1 in
    # row 2 -> kept for every token; 1 and 2 are in some row's head -> kept
    skipped = (ids != out_i) | (out_w != wts)
    assert skipped.tolist() == [[False, False, False, False], [False, False, True, True],
                                [False, False, False, False]]
    assert out_i[1].tolist() == [2, 1, 2, 2] and torch.equal(out_w[1], torch.tensor([.4, .3, 0, 0]))
    assert h.skip.skipped_experts == 2 and h.skip.skipped_pairs == 2
    one_i, one_w = h._tail_skip(0, ids[1:2], wts[1:2])      # one token: the pairs are dropped
    assert one_i.tolist() == [[2, 1]] and torch.equal(one_w, torch.tensor([[.4, .3]]))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("ts"), seed=8)[2]


def _decode_logits(store, **opts):
    with engine(store, **opts) as (eng, sp):
        pre = eng.prefill(PROMPT).clone()
        gets = []
        real = eng.provider.get

        def spy(layer, experts):
            gets.append((layer, list(experts)))
            return real(layer, experts)
        eng.provider.get = spy
        out = [eng.decode(t).clone() for t in (9, 10, 11)]
        return pre, torch.stack(out), gets, stats(eng, sp)


def test_off_by_default_and_exact_when_n_covers_top_k(store):
    pre, exact, gets, st = _decode_logits(store)
    assert "route_tail_skip" not in st
    pre4, same, _, st4 = _decode_logits(store, route_tail_skip=4)      # k = 4
    assert torch.equal(pre4, pre) and torch.equal(same, exact)
    assert st4["route_tail_skip"]["skipped_pairs"] == 0


def test_skips_cold_tail_in_decode_but_never_in_prefill(store):
    pre, exact, gets, _ = _decode_logits(store)
    pre1, lossy, gets1, st = _decode_logits(store, route_tail_skip=1)  # nothing is resident
    assert torch.equal(pre1, pre)                                     # prefill is exact
    assert all(len(ids) == 1 for _, ids in gets1)                     # one expert per layer
    assert all(len(ids) == 4 for _, ids in gets)
    rs = st["route_tail_skip"]
    assert rs["skipped_pairs"] == 3 * 3 * 2 and rs["skipped_pair_share"] == 0.75
    assert rs["skipped_bytes"] > 0
    assert not torch.equal(lossy, exact)
    p, q = exact.softmax(-1), lossy.softmax(-1)
    assert float((p * (p / q).log()).sum(-1).mean()) < 1.0            # lossy, not broken


def test_verify_windows_skip_with_mtp(store):
    with engine(store, mtp=2, route_tail_skip=2) as (eng, sp):
        from expertfs.runtime.generate import generate
        from expertfs.runtime.sampling import Sampler
        toks = [s.token for s in generate(eng, PROMPT, Sampler(), 10, spec=sp.speculator)]
        rs = stats(eng, sp)["route_tail_skip"]
    assert len(toks) == 10 and rs["windows"] > 0 and rs["skipped_pairs"] > 0


def test_tail_skip_with_draft_prefetch_and_plain_steps(store):
    """One-token windows drop pairs (narrower routes) next to verify windows: both recorded."""
    from expertfs.runtime.generate import generate
    from expertfs.runtime.sampling import Sampler
    with engine(store, mtp=2, draft_prefetch=True, route_tail_skip=2, provider="tiered",
                ram_bytes=2 << 20) as (eng, sp):
        toks = [s.token for s in generate(eng, PROMPT, Sampler(), 9, spec=sp.speculator)]
        eng.decode(toks[-1])                                    # a plain one-token window
        sp.speculator.step(toks[-1], Sampler(), 3)
        d = stats(eng, sp)["mtp"]["draft_prefetch"]
    assert len(toks) == 9 and d["steps"] > 0
