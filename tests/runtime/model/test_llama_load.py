"""llama.cpp (through llama-cpp-python) loads every synth architecture and evaluates tokens.

Opt-in: runs only with ``EXPERTFS_LLAMA_TESTS=1`` and ``llama_cpp`` importable (build the
wheel of llama-cpp-python 0.3.36 and ``pip install --no-deps`` it). This is the acceptance test
that the files are what llama.cpp's converter would write: its loader rejects a wrong tensor
count, name, shape, type or metadata key.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from expertfs.synth import ARCHES, SynthConfig, synthesize
from llama_peer import open_llama  # noqa: E402

pytestmark = pytest.mark.llama

llama_cpp = pytest.importorskip("llama_cpp") if os.environ.get("EXPERTFS_LLAMA_TESTS") == "1" else None

PROMPT = b"Beautiful is better than ugly. Explicit is better than implicit."


def _eval(path: str) -> np.ndarray:
    m = open_llama(path, n_ctx=64, logits_all=True)
    try:
        toks = m.tokenize(PROMPT, add_bos=True)
        assert len(toks) < len(PROMPT) // 2, "the BPE merges should shorten the prompt"
        m.eval(toks)
        logits = np.array(m.scores[:len(toks)], dtype=np.float32)
        assert logits.shape == (len(toks), m.n_vocab())
        return logits
    finally:
        m.close()


def _assert_sane(logits: np.ndarray) -> None:
    assert np.isfinite(logits).all()
    assert 0.2 < float(logits.std()) < 5.0           # unit-scale outputs of a random model


@pytest.mark.parametrize("arch", ARCHES, ids=[f"{a}-arch" for a in ARCHES])
def test_llama_cpp_loads_and_evaluates(tmp_path, arch):
    path = synthesize(SynthConfig.tiny(arch), tmp_path / f"{arch}.gguf")[0]
    _assert_sane(_eval(path))


def test_llama_cpp_chat_uses_the_template_and_special_tokens(tmp_path):
    path = synthesize(SynthConfig.tiny("qwen3moe"), tmp_path / "chat.gguf")[0]
    m = open_llama(path, n_ctx=128)
    try:
        assert m.tokenize(b"<|im_end|>", add_bos=False, special=True) == [m.token_eos()]
        out = m.create_chat_completion(messages=[{"role": "user", "content": "Zen?"}],
                                       max_tokens=4, temperature=0.0)
        assert out["usage"]["prompt_tokens"] > 3
    finally:
        m.close()


def test_llama_cpp_computes_with_every_quant_type(tmp_path):
    cfg = SynthConfig.tiny("qwen3moe", n_layers=8, quant="mixed", n_experts=4, n_expert_used=4)
    path = synthesize(cfg, tmp_path / "mixed.gguf")[0]       # top-k = all: every expert runs
    _assert_sane(_eval(path))


def test_llama_cpp_loads_a_split_model(tmp_path):
    paths = synthesize(SynthConfig.tiny("glm4moe"), tmp_path / "s.gguf", split_max_bytes=1 << 20)
    assert len(paths) > 1
    _assert_sane(_eval(paths[0]))


def test_llama_cpp_real_hidden_size_not_a_multiple_of_256(tmp_path):
    # gpt-oss-20b's real layer geometry (hidden 2880: K-quant tensors fall back) with a small vocab
    cfg = SynthConfig.like("gpt-oss-20b", layers=1, n_vocab=2048)
    _assert_sane(_eval(synthesize(cfg, tmp_path / "oss.gguf")[0]))


@pytest.mark.parametrize("arch", ["glm4moe", "deepseek2"])
def test_llama_cpp_loads_the_nextn_block(tmp_path, arch):
    cfg = SynthConfig.tiny(arch, n_nextn=1, nextn_heads=True)
    path = synthesize(cfg, tmp_path / "mtp.gguf")[0]
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.load_mtp = True                     # create (and shape-check) the MTP tensors too
    params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    assert model, "llama.cpp refused the NextN block"
    llama_cpp.llama_model_free(model)
    _assert_sane(_eval(path))
