"""Sampling semantics and the generation loop on a tiny transformers-converted model."""

from __future__ import annotations


import pytest
import torch

from hf_to_gguf import convert  # noqa: E402

from expertfs.errors import UsageError  # noqa: E402
from expertfs.runtime.engine import Engine  # noqa: E402
from expertfs.runtime.generate import generate  # noqa: E402
from expertfs.runtime.sampling import Sampler, SamplingParams  # noqa: E402


def test_greedy_is_argmax_with_lowest_id_on_ties():
    lg = torch.tensor([0.0, 3.0, 3.0, -1.0])
    assert Sampler()(lg) == 1


def test_top_k_one_and_tiny_top_p_are_greedy():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lg = torch.randn(50, generator=g)
        best = int(lg.argmax())
        assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=3))(lg) == best
        assert Sampler(SamplingParams(temperature=1.5, top_p=1e-6, seed=3))(lg) == best


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    lg = torch.log(torch.tensor([0.5, 0.3, 0.2, 1e-9]))
    a = Sampler(SamplingParams(temperature=1.0, seed=42))
    b = Sampler(SamplingParams(temperature=1.0, seed=42))
    xs = [a(lg) for _ in range(3000)]
    assert xs == [b(lg) for _ in range(3000)]
    freq = torch.bincount(torch.tensor(xs), minlength=4).float() / len(xs)
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.04)
    assert freq[3] == 0


def test_top_k_and_top_p_cut_the_tail():
    lg = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=1))
    assert {s(lg) for _ in range(500)} == {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.85, seed=1))
    assert {s(lg) for _ in range(500)} == {0, 1, 2}


def test_bad_sampling_parameters_are_usage_errors():
    for p in (SamplingParams(temperature=-1), SamplingParams(top_p=0.0), SamplingParams(top_k=-2)):
        with pytest.raises(UsageError):
            Sampler(p)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return convert("qwen3moe", str(tmp_path_factory.mktemp("gen")), seed=21)


def test_greedy_generation_equals_transformers(store):
    model, _, path = store
    prompt = [5, 100, 200, 37]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                             pad_token_id=0)[0, len(prompt):].tolist()
    with Engine.open(path, provider="direct") as eng:
        steps = list(generate(eng, prompt, Sampler(), 8))
    assert [s.token for s in steps] == ref
    assert [s.index for s in steps] == list(range(8))
    assert steps[0].seconds > 0 and steps[-1].elapsed >= steps[0].elapsed


def test_generation_stops_at_a_stop_token(store):
    _, _, path = store
    with Engine.open(path, provider="direct") as eng:
        first = list(generate(eng, [1, 2, 3], Sampler(), 5))
        eng.reset()
        stop = {first[2].token}
        steps = list(generate(eng, [1, 2, 3], Sampler(), 5, stop))
    stop_at = next(i for i, s in enumerate(first) if s.token in stop)
    assert len(steps) == stop_at + 1 and steps[-1].stop


def test_sampled_generation_is_reproducible(store):
    _, _, path = store
    runs = []
    for _ in range(2):
        with Engine.open(path, provider="direct") as eng:
            s = Sampler(SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=7))
            runs.append([st.token for st in generate(eng, [4, 5, 6], s, 10)])
    assert runs[0] == runs[1]


def test_bias_adds_to_the_named_tokens_only():
    from expertfs.runtime.sampling import bias
    lg = torch.zeros(4)
    out = bias(lg, {1: 100.0, 3: -100.0, 9: 5.0})          # id 9 is past the vocabulary
    assert out.tolist() == [0.0, 100.0, 0.0, -100.0] and lg.tolist() == [0.0] * 4
    assert Sampler()(out) == 1


def test_allow_restricts_greedy_and_sampled_choices():
    from expertfs.runtime.sampling import allow
    g = torch.Generator().manual_seed(1)
    allowed = torch.tensor([False, True, False, True, False, False])
    for _ in range(50):
        lg = torch.randn(8, generator=g) * 5               # two ids past the mask: never allowed
        out = allow(lg, allowed)
        assert Sampler()(out) in (1, 3)
        assert Sampler(SamplingParams(temperature=2.0, top_k=5, top_p=0.9,
                                      seed=int(torch.randint(0, 99, (1,), generator=g))))(out) in (1, 3)
