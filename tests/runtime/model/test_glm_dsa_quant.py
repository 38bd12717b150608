"""glm-dsa (GLM-5.2) on quantized files against transformers on the same weights dequantised.

The tiny model of test_glm_dsa.py, 256 wide (so the Maya types' 256-element rows fit), is
converted by llama.cpp's converter twice: once with every weight replaced by its own id (which
gives the converter's tensor mapping inverted, support.gguf_inverse) and once with
``--outtype q8_0``. A Maya-S file (``--quant maya-s``: IQ2_XXS gate/up, IQ2_S/IQ3_XXS down, Q6_K
trunk, Q8_0 indexer, F32 router; llama-quantize's fallbacks for short rows) is written in the
converted file's layout, the types gguf-py cannot quantize as random valid blocks. For each
file the reference is transformers run on its tensors dequantised by gguf-py and put back by
the inverted mapping; the engine's logits equal it (max |d| <= 1e-3) at every position, for the
whole prompt, in batches of 5 and one token at a time.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from llamacpp_convert import ConverterUnavailable, convert, tiny_bpe_tokenizer
from support.gguf_inverse import (IdSpace, assert_q8_0_holds_the_model, dequantised, maya_types,
                                  requantise, types_of)
from test_glm_dsa import N_LAYERS, TOKENS, _config, _gaps

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.experts.direct import DirectProvider
from expertfs.store.reader import Store
from expertfs.store.repack import repack

TOL = 1e-3
SEED = 0
GAP = 2e-5                    # both sides run the same weights: only rounding separates them
DEVICE = os.environ.get("EXPERTFS_TEST_DEVICE", "cpu")
GEOM = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, q_lora_rank=64)


def _model(seed: int, n_layers: int = N_LAYERS):
    import transformers as tf
    torch.manual_seed(seed)
    m = tf.GlmMoeDsaForCausalLM(_config(n_layers, **GEOM)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
        for layer in m.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return m


def _nextn(seed: int) -> dict[str, torch.Tensor]:
    m5 = _model(seed + 100, N_LAYERS + 1)
    p = f"model.layers.{N_LAYERS}."
    out = {k: v.detach().clone().contiguous() for k, v in m5.state_dict().items()
           if k.startswith(p) and ".mlp.experts." not in k}
    ex = m5.model.layers[N_LAYERS].mlp.experts
    for e in range(ex.num_experts):
        gate, up = ex.gate_up_proj[e].detach().chunk(2, dim=0)
        for n, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", ex.down_proj[e])):
            out[f"{p}mlp.experts.{e}.{n}.weight"] = t.detach().clone().contiguous()
    g = torch.Generator().manual_seed(seed + 200)
    D = m5.config.hidden_size
    out[p + "eh_proj.weight"] = torch.randn(D, 2 * D, generator=g) * 0.05
    for n in ("enorm", "hnorm", "shared_head.norm"):
        out[p + n + ".weight"] = 1.0 + 0.2 * torch.randn(D, generator=g)
    return out


def _save(d, model, nextn) -> None:
    from safetensors.torch import load_file, save_file
    model.save_pretrained(d)
    tiny_bpe_tokenizer(d, model.config.vocab_size)
    st = d / "model.safetensors"
    save_file({**load_file(st), **nextn}, st, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm_dsa_quant")
    model, nextn = _model(SEED), _nextn(SEED)
    space = IdSpace({"model": model.state_dict(), "nextn": nextn})
    ids = space.ids()
    id_model = copy.deepcopy(model)
    id_model.load_state_dict(ids["model"])
    _save(d / "hf_ids", id_model, ids["nextn"])
    _save(d / "hf", model, nextn)
    try:
        id_gguf = convert(d / "hf_ids", d / "ids.gguf", outtype="f32")
        q8 = convert(d / "hf", d / "model-Q8_0.gguf", outtype="q8_0")
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp's converter is unavailable: {e}")
    index, other = space.index_map(id_gguf)
    assert other == []                             # glm-dsa: every tensor a copy by position
    maya = d / "model-maya-s.gguf"
    requantise(id_gguf, maya, maya_types(list(index), N_LAYERS), space.gather(index), seed=SEED)
    files = {"q8_0": q8, "maya-s": maya}
    stores = {}
    for k, f in files.items():
        stores[k] = str(d / f"{k}.efs")
        repack([str(f)], stores[k], force=True)
    return model, space, index, files, stores


def _reference(built, kind):
    model, space, index, files, _ = built
    groups = space.load(index, dequantised(files[kind]))
    lo = space.slots[0][2]
    hi = lo + sum(t.numel() for t in model.state_dict().values())
    assert space.covered[lo:hi].all()            # every transformers weight came from the file
    ref = copy.deepcopy(model)
    ref.load_state_dict(groups["model"])
    with torch.no_grad():
        return ref, ref(torch.tensor([TOKENS])).logits[0].numpy()


@pytest.fixture(scope="module")
def refs(built):
    return {k: _reference(built, k) for k in built[3]}


def test_the_files_have_the_types_asked_for(built):
    files = built[3]
    q8 = types_of(files["q8_0"])
    assert q8["blk.1.ffn_gate_exps.weight"] == "Q8_0" and q8["blk.1.ffn_gate_inp.weight"] == "F32"
    assert q8["blk.0.indexer.proj.weight"] == "F32"
    maya = types_of(files["maya-s"])
    assert {maya[f"blk.{i}.ffn_gate_exps.weight"] for i in (1, 2, 3, 4)} == {"IQ2_XXS"}
    assert {maya[f"blk.{i}.ffn_down_exps.weight"] for i in (1, 2, 3, 4)} == {"IQ2_S", "IQ3_XXS"}
    assert maya["blk.1.attn_kv_a_mqa.weight"] == maya["token_embd.weight"] == "Q6_K"
    assert maya["blk.0.indexer.attn_k.weight"] == "Q8_0"
    assert maya["blk.1.ffn_gate_inp.weight"] == maya["blk.1.exp_probs_b.bias"] == "F32"


def test_the_q8_0_file_holds_the_model_up_to_rounding(built):
    _, space, index, files, _ = built
    assert_q8_0_holds_the_model(space, index, files["q8_0"])


@pytest.mark.parametrize("kind", ["q8_0", "maya-s"])
def test_the_seed_gives_every_top_k_a_clear_gap(refs, kind):
    idx_gap, route_gap = _gaps(refs[kind][0], TOKENS)
    assert idx_gap > GAP and route_gap > GAP


@pytest.mark.parametrize("batch", [512, 5, 1], ids=["whole", "batches-of-5", "one-by-one"])
@pytest.mark.parametrize("kind", ["q8_0", "maya-s"])
def test_logits_equal_transformers_on_the_dequantised_weights(built, refs, kind, batch):
    ref = refs[kind][1]
    store = built[4][kind]
    with Store.open(store) as st:
        eng = Engine(st, DirectProvider(st, DEVICE), EngineOptions(
            device=DEVICE, dtype="float32", prefill_batch=batch))
        try:
            ours = eng.logits(TOKENS).numpy()
        finally:
            eng.close()
    d = np.abs(ours - ref).max()
    print(f"max |d| {kind} {batch}: {d:.3g}")
    assert ours.shape == ref.shape and d <= TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
