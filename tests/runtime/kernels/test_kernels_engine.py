"""The native kernels inside the engine: exact decode equals the eager torch path; the opt-in
``act_quant="q8"`` mode is really on (experts and trunk), stays close to exact, and is validated; ``expertfs run
--act-quant q8`` reaches the runner."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from expertfs.errors import UsageError
from expertfs.runtime import kernels
from expertfs.runtime.engine import Engine

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels unavailable: "
                                f"{kernels.status()['reason']}")


def make_store(tmp_path_factory, arch: str, quant: str = "q4_k_m") -> str:
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    d = tmp_path_factory.mktemp(f"kern_{arch}")
    g, s = d / "m.gguf", d / "m.efs"
    synthesize(SynthConfig.tiny(arch).replace(quant=quant, n_layers=3), str(g))
    repack([str(g)], str(s))
    return str(s)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory, "qwen3moe")


def decode_logits(store: str, steps: list[int], **kw) -> torch.Tensor:
    with Engine.open(store, provider="direct", **kw) as e:
        out = [e.prefill(steps[:1])]
        out += [e.decode(t) for t in steps[1:]]
        return torch.stack(out)


def test_native_decode_equals_eager_and_q8_is_close(store):
    steps = [5, 17, 300, 42, 7, 99, 512, 3]
    eager = decode_logits(store, steps, fused="off")
    exact = decode_logits(store, steps)
    q8 = decode_logits(store, steps, act_quant="q8")
    scale = float(eager.abs().max())
    assert torch.allclose(exact, eager, atol=1e-4 * scale, rtol=0)
    d = float((q8 - exact).abs().max())
    # on (far beyond float rounding) and a perturbation, not garbage (its size on real models
    # is measured by bench/bench_decode_actquant.py)
    assert 100 * float((exact - eager).abs().max()) < d < 0.25 * scale


def test_act_quant_is_validated(store):
    with pytest.raises(UsageError, match="unknown activation quantization"):
        Engine.open(store, provider="direct", act_quant="q4")
    with Engine.open(store, provider="direct", act_quant="q8") as e:
        assert e.runner.act_quant == "q8" and e.runner.fused


def test_q8_reaches_the_trunk_products(store, monkeypatch):
    """``act_quant="q8"`` covers the trunk too (attention, the output head), as llama.cpp
    quantizes every product's activations; the default keeps every trunk product exact."""
    from expertfs.runtime.model import weights
    from expertfs.runtime.model.loader import linears
    modes = []
    dm = weights.decode_matvec

    def spy(x, raw, t, shape, act_quant=None):
        modes.append(act_quant)
        return dm(x, raw, t, shape, act_quant)
    monkeypatch.setattr(weights, "decode_matvec", spy)
    for aq, want in (("off", {None}), ("q8", {"q8"})):
        modes.clear()
        with Engine.open(store, provider="direct", act_quant=aq) as e:
            quant = [m for m in linears(e.trunk, nextn=True) if m.q is not None]
            assert quant and {m.act_quant for m in quant} == want
            e.prefill([5])
            e.decode(17)
        assert modes and set(modes) == want, aq


def test_cli_flag_reaches_the_runner(store, capsys, monkeypatch):
    from expertfs.cli import main
    seen = {}
    orig = Engine.__init__

    def spy(self, *a, **k):
        orig(self, *a, **k)
        seen["act_quant"] = self.runner.act_quant
    monkeypatch.setattr(Engine, "__init__", spy)
    assert main(["run", store, "-p", "hello", "-n", "2", "--ignore-eos", "--json",
                 "--provider", "direct", "--act-quant", "q8"]) == 0
    assert seen["act_quant"] == "q8"
    assert isinstance(json.loads(capsys.readouterr().out), dict)


def test_cli_tokens_logits_in_q8(store, tmp_path):
    """``run --tokens --logits-out --act-quant q8`` writes llama.cpp's numerics (the fused
    path's q8 products), not the exact logits: the comparison a user runs it for."""
    from expertfs.cli import main
    out = {aq: tmp_path / f"{aq}.npy" for aq in ("off", "q8")}
    for aq, f in out.items():
        assert main(["run", store, "--tokens", "3,14,15,92,65", "--logits-out", str(f),
                     "--provider", "direct", "--act-quant", aq]) == 0
    exact, q8 = (torch.from_numpy(np.load(out[aq])) for aq in ("off", "q8"))
    assert 0 < float((q8 - exact).abs().max()) < 0.05 * float(exact.abs().max())


@pytest.fixture(scope="module")
def glm_store(tmp_path_factory):
    """glm4moe: a shared expert (computed while the misses load) and a leading dense layer."""
    return make_store(tmp_path_factory, "glm4moe")


@pytest.fixture(scope="module")
def maya_store(tmp_path_factory):
    """The Maya-S mix: IQ2_XXS gate/up, IQ2_S / IQ3_XXS down, Q6_K trunk."""
    return make_store(tmp_path_factory, "qwen3moe", "maya-s")


def test_iq_mix_decodes_natively_and_equals_eager(maya_store, monkeypatch):
    """The lattice IQ types take the native layer call (not the torch fallback) and the exact
    logits equal the eager torch path's; q8 is on."""
    taken = []
    moe = kernels.moe

    def counting(*a, **k):
        y = moe(*a, **k)
        taken.append(y is not None)
        return y
    steps = [5, 17, 300, 42, 7, 99]
    eager = decode_logits(maya_store, steps, fused="off")
    monkeypatch.setattr(kernels, "moe", counting)
    exact = decode_logits(maya_store, steps)
    q8 = decode_logits(maya_store, steps, act_quant="q8")
    assert taken and all(taken)
    scale = float(eager.abs().max())
    assert torch.allclose(exact, eager, atol=1e-4 * scale, rtol=0)
    # q8 quantizes the trunk's activations too: on this 3-layer random model the last
    # position moves by up to about a third of the logits' scale
    assert 100 * float((exact - eager).abs().max()) < float((q8 - exact).abs().max()) < 0.5 * scale


@pytest.mark.parametrize("act_quant", ["off", "q8"])
@pytest.mark.parametrize("which", ["store", "glm_store", "maya_store"])
def test_decode_overlapping_reads_equals_one_call_bit_for_bit(request, which, act_quant):
    """A RAM tier of a few experts: most decode steps find some experts resident and others
    missing, compute the resident ones' gate/up rows (and the shared expert) while the rest are
    read, then finish in routing order. The logits equal the all-resident direct provider's
    exactly."""
    store = request.getfixturevalue(which)
    steps = [5, 17, 300, 42, 7, 99, 512, 3, 64, 1000, 12, 250]
    with Engine.open(store, provider="direct", act_quant=act_quant) as e:
        want = torch.stack([e.prefill(steps[:1])] + [e.decode(t) for t in steps[1:]])
        slot = max(e.store.extent(la, 0).length for la in e.store.layers)
    with Engine.open(store, provider="tiered", ram_bytes=24 * slot, act_quant=act_quant,
                     provider_options={"warm_start": False, "backend": "buffered",
                                       "record_usage": False}) as e:
        got = torch.stack([e.prefill(steps[:1])] + [e.decode(t) for t in steps[1:]])
        overlapped = e.runner.stats.overlapped
        misses = e.provider.stats.misses
    assert overlapped > 0 and misses > 0
    assert torch.equal(got, want)


def test_small_steps_run_torch_on_one_thread_and_restore_it(store, monkeypatch):
    """With the native kernels, a decode step runs torch's own small ops on one thread (the
    kernels keep their pool) and gives back the caller's thread count; the logits agree with
    the step run multi-threaded, and a long batch (prefill) is left alone."""
    from expertfs.runtime.model import model as M
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    real = torch.set_num_threads
    seen: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    steps = [5, 17, 300, 42, 7]
    try:
        with Engine.open(store, provider="direct") as e:
            assert e.model.small_steps_one_thread
            e.prefill(list(range(1, M.SMALL_STEP_TOKENS + 3)))
            assert seen == []                                   # a long batch: untouched
            one = torch.stack([e.decode(t) for t in steps])
            assert seen == [1, 2] * len(steps) and torch.get_num_threads() == 2
            e.reset()
            e.model.small_steps_one_thread = False
            e.prefill(list(range(1, M.SMALL_STEP_TOKENS + 3)))
            many = torch.stack([e.decode(t) for t in steps])
    finally:
        real(before)
    assert torch.allclose(one, many, atol=1e-5 * float(many.abs().max()), rtol=0)
