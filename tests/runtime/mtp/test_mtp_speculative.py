"""Speculative decoding: greedy output equals plain greedy decoding token for token (drafts
rejected, partly accepted, all accepted), the KV caches roll back, sampled output keeps the
target distribution (checked statistically on a small vocabulary), and the run is reproducible
from its seed."""

from __future__ import annotations

import itertools

import pytest

from support.mtp_model import build_model, engine, greedy_plain, one_thread, stats  # noqa: F401

torch = pytest.importorskip("torch")

from expertfs.runtime.generate import generate  # noqa: E402
from expertfs.runtime.mtp.accept import accept_sampled, draft, target_probs  # noqa: E402
from expertfs.runtime.sampling import Sampler, SamplingParams  # noqa: E402

PROMPT = [5, 100, 200, 37, 400, 12, 7, 300, 255, 1, 2, 3]
N = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, _, store = build_model(tmp_path_factory.mktemp("spec"), seed=4)
    with engine(store) as (eng, _):
        ref = greedy_plain(eng, PROMPT, N)
    return store, ref


def _gen(eng, sp, n=N, params=SamplingParams()):
    return [s.token for s in generate(eng, PROMPT, Sampler(params), n, spec=sp.speculator)]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_plain_with_the_models_own_drafts(tiny, k):
    store, ref = tiny
    with engine(store, mtp=k) as (eng, sp):
        assert _gen(eng, sp) == ref
        st = stats(eng, sp)["mtp"]
    assert st["steps"] > 0 and st["drafted"] > 0
    assert st["emitted"] >= N - 1


def _oracle(eng, sp, truth: list[int], wrong_every: int):
    """Drafts the true continuation, but a wrong token every ``wrong_every``-th draft."""
    calls = itertools.count()

    def fn(logits, params, gen):
        pos = sp.speculator.nextn.pos                 # the drafted token's position
        i = pos - len(PROMPT)
        t = truth[i] if 0 <= i < len(truth) else 0
        if wrong_every and next(calls) % wrong_every == wrong_every - 1:
            t = (t + 1) % eng.config.n_vocab
        return t, None, 0.9
    return fn


@pytest.mark.parametrize("k,wrong", [(4, 0), (4, 3), (2, 2)])
def test_greedy_equals_plain_with_partly_right_drafts(tiny, k, wrong):
    store, ref = tiny
    with engine(store, mtp=k) as (eng, sp):
        sp.speculator.draft_fn = _oracle(eng, sp, ref, wrong)
        got = []
        sampler = Sampler()
        got.append(sampler(eng.prefill(PROMPT)))
        while len(got) < N:
            P = eng.pos
            toks = sp.speculator.step(got[-1], sampler, N - len(got))
            assert 1 <= len(toks) <= min(k + 1, N - len(got))
            assert eng.pos == P + len(toks)                 # last + accepted drafts in the KV
            assert sp.speculator.nextn.pos <= P + 1              # chained NextN rows rolled back
            got += toks
            assert sp.speculator.tokens == (PROMPT + got)[:eng.pos]
        st = sp.speculator.stats
    assert got == ref
    if wrong == 0:
        assert st.accepted == st.drafted                    # every oracle draft accepted
    else:
        assert 0 < st.accepted < st.drafted


def test_reset_to_a_prefix_then_continue(tiny):
    store, ref = tiny
    with engine(store, mtp=2) as (eng, sp):
        assert _gen(eng, sp) == ref
        eng.reset(len(PROMPT) + 5)                           # keep the prompt + 5 tokens
        sampler = Sampler()
        got = ref[:6]
        while len(got) < N:
            got += sp.speculator.step(got[-1], sampler, N - len(got))
        assert got == ref


def test_sampled_is_reproducible_and_mtp_tracks_plain_statistics(tiny):
    store, _ = tiny
    p = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    with engine(store, mtp=2) as (eng, sp):
        a = _gen(eng, sp, params=p)
        eng.reset()
        b = _gen(eng, sp, params=p)
    assert a == b and len(a) == N


# --- the output distribution of speculative sampling, on a toy pair of models --------------

V = 4
PARAMS = SamplingParams(temperature=1.0, top_p=0.9)


def _logits(prefix: tuple[int, ...], salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((prefix, salt)) % (1 << 31))
    return 2.0 * torch.randn(V, generator=g)


def _target(prefix):
    return _logits(prefix, 0)


def _drafter(prefix):                          # a different but correlated draft model
    return 0.5 * _target(prefix) + _logits(prefix, 1)


def _spec_two(gen: torch.Generator, k: int, accept=accept_sampled) -> tuple[int, int]:
    """The first two tokens emitted by speculative decoding with ``k`` drafts per step."""
    out: list[int] = []
    ctx: tuple[int, ...] = (0,)
    while len(out) < 2:
        drafts, qs = [], []
        for _ in range(k):
            d, q, _ = draft(_drafter(ctx + tuple(drafts)), PARAMS, gen)
            drafts.append(d)
            qs.append(q)
        rows = torch.stack([_target(ctx + tuple(drafts[:i])) for i in range(k + 1)])
        n, nxt = accept(rows, drafts, qs, PARAMS, gen)
        new = drafts[:n] + [nxt]
        out += new
        ctx += tuple(new)
    return out[0], out[1]


def _chi2(counts: dict, n: int) -> float:
    chi = 0.0
    for a in range(V):
        pa = target_probs(_target((0,)), PARAMS)[a]
        pb = target_probs(_target((0, a)), PARAMS)
        for b in range(V):
            e = n * float(pa * pb[b])
            o = counts.get((a, b), 0)
            if e == 0:
                assert o == 0, f"({a}, {b}) has probability 0 but was emitted"
                continue
            chi += (o - e) ** 2 / e
    return chi


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_sampling_keeps_the_target_distribution(k):
    gen = torch.Generator().manual_seed(123)
    n = 6000
    counts: dict[tuple[int, int], int] = {}
    for _ in range(n):
        key = _spec_two(gen, k)
        counts[key] = counts.get(key, 0) + 1
    # 16 cells, at most 15 degrees of freedom: chi2 < 37.7 at p = 0.001
    assert _chi2(counts, n) < 37.7


def test_the_distribution_check_has_power():
    """Accepting every draft (wrong) emits the draft model's distribution: caught."""
    def always(rows, drafts, qs, p, gen):
        return len(drafts), int(torch.multinomial(target_probs(rows[-1], p), 1, generator=gen))
    gen = torch.Generator().manual_seed(123)
    n = 6000
    counts: dict[tuple[int, int], int] = {}
    for _ in range(n):
        key = _spec_two(gen, 2, accept=always)
        counts[key] = counts.get(key, 0) + 1
    with pytest.raises(AssertionError):
        assert _chi2(counts, n) < 37.7
