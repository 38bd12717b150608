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


def ours(store: str, tokens: list[int], act_quant: str = "off") -> np.ndarray:
    with Engine.open(store, provider="direct", act_quant=act_quant) as eng:
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


@pytest.mark.parametrize("quant", ["q4_k_m", "q3_k_m", "Q4_K,experts=Q2_K,down=Q3_K,output=Q6_K"])
def test_synth_model_with_k_quants_agrees(tmp_path, quant):
    """A synth qwen3moe in K-quant mixes (which gguf-py cannot write: Q4_K_M, Q3_K_M, a
    Q2_K_XL-style one) through both: the 13-token prompt's trunk products and its busier
    experts' (8 experts, top-2) take the panel products. Exact mode differs from llama.cpp's
    8-bit activations, and the low-bit mixes' logits of this random tiny model have near-ties
    (11 of 13 top-1 on the two low-bit ones);
    ``act_quant="q8"`` is llama.cpp's numerics, so its logits agree but for float order."""
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    cfg = SynthConfig.tiny("qwen3moe").replace(quant=quant, n_layers=3)
    gguf = str(tmp_path / "s.gguf")
    synthesize(cfg, gguf)
    repack([gguf], str(tmp_path / "s.efs"))
    toks = list(range(3, 40, 3))
    ref = llama_logits(gguf, toks)
    got = ours(str(tmp_path / "s.efs"), toks)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    assert np.median(np.abs(got - ref)) < 0.05
    q8 = ours(str(tmp_path / "s.efs"), toks, "q8")
    assert (q8.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    assert np.median(np.abs(q8 - ref)) < 1e-4


@pytest.mark.parametrize("arch", ["deepseek2", "glm-dsa", "glm5-next"])
def test_mla_q8_mode_is_llama_cpps_numerics(tmp_path, arch):
    """MLA's per-head ``k_b``/``v_b`` products take q8 activations too: short prompts (every
    product on the row kernels) in q8 mode give llama.cpp's logits but for float order. Float
    order can still flip a near-tie of the tiny random router (group-limited on deepseek2) at
    some position of some prompt, which the box's ISA decides (on a Zen 5 the first prompt
    here, from its second position), so most positions must agree, not every one; with the
    heads' products exact (the defect this guards against) no position of these does."""
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    gguf = str(tmp_path / "m.gguf")
    synthesize(SynthConfig.tiny(arch).replace(quant="Q8_0"), gguf)
    repack([gguf], str(tmp_path / "m.efs"))
    same = []
    for toks in ([5, 100, 37], [7, 200, 41, 9], [11, 12, 13, 14, 15], [300, 2, 77, 150]):
        ref = llama_logits(gguf, toks)
        same += list(np.abs(ours(str(tmp_path / "m.efs"), toks, "q8") - ref).max(-1) < 1e-4)
    assert np.mean(same) >= 0.75, same
