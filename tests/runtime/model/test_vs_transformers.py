"""Our logits against transformers' on the same weights (Qwen3Moe, Glm4Moe, Mixtral).

Each model is built by transformers from a small config with seeded random weights, written to
GGUF by tools/hf_to_gguf.py with llama.cpp's names and metadata, repacked into a store and run
by the engine. All-F32 weights: equal at float32 tolerance. Quantized weights loaded back into
transformers (``sync``): equal at float32 tolerance too (our dequant is exact). Quantized
weights against the original float model: close, with the same argmax almost everywhere.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from hf_to_gguf import KINDS, convert  # noqa: E402

from expertfs.runtime.engine import Engine, EngineOptions  # noqa: E402
from expertfs.runtime.experts.direct import DirectProvider  # noqa: E402
from expertfs.store.reader import Store  # noqa: E402

TOKENS = [5, 100, 200, 37, 400, 12, 7, 300, 255, 1, 2, 3, 77, 500, 9, 64]
F32_TOL = 1e-4
#: bench/gpu_check.sh runs this file with EXPERTFS_TEST_DEVICE=cuda
DEVICE = os.environ.get("EXPERTFS_TEST_DEVICE", "cpu")


def _ref(model, tokens=TOKENS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def _ours(store: str, tokens=TOKENS, **opts) -> np.ndarray:
    from support.oracle import engine_logits
    return engine_logits(store, tokens, DEVICE, **opts)


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    return {k: convert(k, str(d), seed=1) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_f32_logits_equal_transformers(f32_models, kind):
    model, _, store = f32_models[kind]
    ref, ours = _ref(model), _ours(store)
    assert ours.shape == ref.shape == (len(TOKENS), model.config.vocab_size)
    assert np.abs(ours - ref).max() < F32_TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_mla_prompt_in_query_chunks_equals_transformers(f32_models, monkeypatch):
    """MLA's dense attention absorbs a prompt's queries a chunk of tokens at a time
    (``mla.MLA_QUERY_CHUNK``): at one token a chunk the logits are transformers' still."""
    from expertfs.runtime.model import mla
    monkeypatch.setattr(mla, "MLA_QUERY_CHUNK", 1)
    model, _, store = f32_models["deepseek2"]
    ref, ours = _ref(model), _ours(store)
    assert np.abs(ours - ref).max() < F32_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_decode_equals_one_batch(f32_models, kind):
    """Prefill in batches of 5, then one token at a time: the same logits as one forward."""
    model, _, store = f32_models[kind]
    ref = _ref(model)
    with Store.open(store) as st:
        eng = Engine(st, DirectProvider(st, DEVICE),
                     EngineOptions(prefill_batch=5, device=DEVICE, dtype="float32"))
        try:
            last = eng.prefill(TOKENS[:11])
            rows = [last.cpu().numpy()]
            for t in TOKENS[11:]:
                rows.append(eng.decode(t).cpu().numpy())
        finally:
            eng.close()
    got = np.stack(rows)
    assert np.abs(got - ref[10:]).max() < F32_TOL


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qt", [T.Q8_0, T.Q4_0])
def test_quantized_experts_exact_against_the_same_weights(tmp_path, kind, qt):
    """Quantized experts and matrices, transformers given the dequantized values: fp32 equal."""
    model, _, store = convert(kind, str(tmp_path), seed=2, expert_type=qt, matrix_type=T.Q8_0,
                              sync=True)
    for trunk in ("float", "quant"):
        ours = _ours(store, trunk=trunk)
        assert np.abs(ours - _ref(model)).max() < F32_TOL, trunk


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_experts_close_to_the_float_model(tmp_path, kind):
    model, _, store = convert(kind, str(tmp_path), seed=3, expert_type=T.Q8_0)
    ref, ours = _ref(model), _ours(store)
    assert np.abs(ours - ref).max() < 0.5
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_glm4moe_nextn_block_is_loaded_not_run(tmp_path):
    model, _, store = convert("glm4moe", str(tmp_path), seed=4, nextn=True)
    with Engine.open(store, provider="direct", device=DEVICE, dtype="float32") as eng:
        assert eng.config.n_nextn == 1 and eng.config.n_layers == model.config.num_hidden_layers
        (blk,) = eng.trunk.nextn
        assert blk.layer == eng.config.n_layers and blk.moe is not None
        assert {"eh_proj", "enorm", "hnorm", "shared_head_norm"} <= set(blk.nextn)
        assert blk.nextn["eh_proj"].out_features == eng.config.n_embd
        ours = eng.logits(TOKENS).numpy()
        assert eng.provider.stats.requests > 0
    assert np.abs(ours - _ref(model)).max() < F32_TOL


def test_bfloat16_compute_stays_close(f32_models):
    model, _, store = f32_models["qwen3moe"]
    ref, ours = _ref(model), _ours(store, dtype="bfloat16")
    assert np.abs(ours - ref).max() < 0.5
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
