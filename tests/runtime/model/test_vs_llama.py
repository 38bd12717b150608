"""Our logits against llama.cpp's (llama-cpp-python) on the same GGUF. Opt-in: EXPERTFS_LLAMA_TESTS=1.

llama.cpp runs with an F32 KV cache (``type_k=type_v=0``) and its weight repacking off
(``use_extra_bufts=False``). All-F32 weights agree at float32 tolerance; with quantized weights
llama.cpp also quantizes the activations (Q8_0/Q8_K dot products), so logits differ by ~1e-2
and an occasional near-tie in expert selection flips: top-1 agreement is what is asserted.
"""

from __future__ import annotations


import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hf_to_gguf import KINDS, convert  # noqa: E402
from llama_peer import llama_logits  # noqa: E402

from expertfs.runtime.engine import Engine  # noqa: E402

TOKENS = [5, 100, 200, 37, 400, 12, 7, 300, 255, 1, 2, 3, 77, 500, 9, 64]
pytestmark = pytest.mark.llama


def ours(store: str, tokens: list[int]) -> np.ndarray:
    with Engine.open(store, provider="direct") as eng:
        return eng.logits(tokens).numpy()


@pytest.mark.parametrize("kind", KINDS)
def test_f32_equals_llama_cpp(tmp_path, kind):
    _, gguf, store = convert(kind, str(tmp_path), seed=5, nextn=kind == "glm4moe")
    ref, got = llama_logits(gguf, TOKENS), ours(store, TOKENS)
    assert np.abs(got - ref).max() < 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qt", [T.Q8_0, T.Q4_0, T.MXFP4])
def test_quantized_top1_agrees_with_llama_cpp(tmp_path, kind, qt):
    _, gguf, store = convert(kind, str(tmp_path), seed=6, expert_type=qt, matrix_type=T.Q8_0)
    ref, got = llama_logits(gguf, TOKENS), ours(store, TOKENS)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.85
    assert np.median(np.abs(got - ref)) < 0.05


def test_synth_model_with_k_quants_agrees(tmp_path):
    """A synth qwen3moe in Q4_K_M (K-quants, which gguf-py cannot write) through both."""
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    cfg = SynthConfig.tiny("qwen3moe").replace(quant="q4_k_m", n_layers=3)
    gguf = str(tmp_path / "s.gguf")
    synthesize(cfg, gguf)
    repack([gguf], str(tmp_path / "s.efs"))
    toks = list(range(3, 40, 3))
    ref, got = llama_logits(gguf, toks), ours(str(tmp_path / "s.efs"), toks)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.85
