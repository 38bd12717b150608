"""glm5-next (GLM-5.3-Flash) on quantized files against transformers on the same weights
dequantised.

The tiny model of test_glm5_next.py, 256 wide (so the Maya types' 256-element rows fit), is
converted by llama.cpp's converter twice: once with every weight replaced by its own id (which
gives the converter's tensor mapping inverted, support.gguf_inverse; ``ssm_a = -exp(A_log)``
is inverted by name) and once with ``--outtype q8_0``. A Maya-S file (``--quant maya-s``:
IQ2_XXS gate/up, IQ2_S/IQ3_XXS down, Q6_K trunk, Q8_0 KDA and indexer matrices, F32 router and
mixing weights; llama-quantize's fallbacks for short rows) is written in the converted file's
layout, the types gguf-py cannot quantize as random valid blocks. For each file the reference
is transformers run on its tensors dequantised by gguf-py; the engine's logits equal it
(max |d| <= 1e-3) at every position, for the whole prompt, in batches of 5 and one at a time.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch

from llamacpp_convert import ConverterUnavailable, convert, tiny_bpe_tokenizer
from support.gguf_inverse import (IdSpace, assert_q8_0_holds_the_model, dequantised, maya_types,
                                  requantise, types_of)
from test_glm5_next import (INDEXER_TYPES, KPOOL, LAYER_TYPES, N_LAYERS, TOKENS, TOP_K, VOCAB,
                            _checkpoint, _gaps, _hf_config, _ref)

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.experts.direct import DirectProvider
from expertfs.store.reader import Store
from expertfs.store.repack import repack

TOL = 1e-3
SEED = 1
MAYA_SEED = 2                 # the random Maya blocks: every top-k with a clear gap
GAP = 1e-4
DEVICE = os.environ.get("EXPERTFS_TEST_DEVICE", "cpu")
KDA_LAYERS = [i for i, t in enumerate(LAYER_TYPES[:N_LAYERS]) if t == "linear_attention"]


def _model(seed: int, n_layers: int = N_LAYERS):
    from transformers.models.glm5_next import modeling_glm5_next as M

    from glm5next_ref import seed_, tiny_config
    cfg = tiny_config(n_layers, vocab_size=VOCAB, hidden_size=256, intermediate_size=256,
                      moe_intermediate_size=256, layer_types=LAYER_TYPES[:n_layers],
                      indexer_types=INDEXER_TYPES[:n_layers],
                      mlp_layer_types=(["dense"] + ["sparse"] * 4)[:n_layers],
                      n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                      routed_scaling_factor=2.5, index_topk=TOP_K, index_kpool=KPOOL,
                      index_n_heads=4, swiglu_limit=1.5, linear_lower_bound=-5.0, pad_token_id=0)
    text = M.Glm5NextTextModel(cfg)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    seed_(text, seed, std=0.1)
    seed_(head, seed + 1, std=0.05)
    with torch.no_grad():
        for layer in text.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(
                    0.0, 0.05, generator=torch.Generator().manual_seed(seed + 2))
    return text, head


def _with(module, state: dict[str, torch.Tensor]):
    m = copy.deepcopy(module)
    m.load_state_dict(state, strict=False)
    return m


def _a_log(i: int) -> str:
    return f"layers.{i}.self_attn.forget_gate.A_log"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from safetensors.torch import save_file
    d = tmp_path_factory.mktemp("glm5_next_quant")
    text, head = _model(SEED)
    t5, _ = _model(SEED + 100, N_LAYERS + 1)
    p = f"model.layers.{N_LAYERS}."
    g = torch.Generator().manual_seed(SEED + 200)
    D = text.config.hidden_size
    extra = {p + "eh_proj.weight": torch.randn(D, 2 * D, generator=g) * 0.05}
    for n in ("enorm", "hnorm", "shared_head.norm"):
        extra[p + n + ".weight"] = 1.0 + 0.2 * torch.randn(D, generator=g)
    t5_layer = {k: v for k, v in t5.state_dict().items() if k.startswith(f"layers.{N_LAYERS}.")}
    space = IdSpace({"text": text.state_dict(), "head": head.state_dict(), "t5": t5_layer,
                     "extra": extra}, skip=lambda name: name.endswith("A_log"))

    def write(where, groups):
        tx, hd, t5x = (_with(m, groups[k]) for m, k in ((text, "text"), (head, "head"),
                                                         (t5, "t5")))
        nx = {k: v for k, v in _checkpoint(t5x, None, N_LAYERS, nextn=True).items()
              if k.startswith(p)}
        where.mkdir()
        (where / "config.json").write_text(json.dumps(_hf_config(text.config)))
        tiny_bpe_tokenizer(where, VOCAB)
        save_file({**_checkpoint(tx, hd), **nx, **groups["extra"]},
                  where / "model.safetensors", metadata={"format": "pt"})
    write(d / "hf_ids", space.ids())
    write(d / "hf", space.groups)
    try:
        id_gguf = convert(d / "hf_ids", d / "ids.gguf", outtype="f32")
        q8 = convert(d / "hf", d / "model-Q8_0.gguf", outtype="q8_0")
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp's converter is unavailable: {e}")
    index, other = space.index_map(id_gguf)
    assert sorted(other) == sorted(f"blk.{i}.ssm_a" for i in KDA_LAYERS)
    values = space.gather(index)
    for i in KDA_LAYERS:
        values[f"blk.{i}.ssm_a"] = (-torch.exp(text.state_dict()[_a_log(i)].float())).numpy()
    maya = d / "model-maya-s.gguf"
    requantise(id_gguf, maya, maya_types(list(index) + other, N_LAYERS), values, seed=MAYA_SEED)
    files = {"q8_0": q8, "maya-s": maya}
    stores = {}
    for k, f in files.items():
        stores[k] = str(d / f"{k}.efs")
        repack([str(f)], stores[k], force=True)
    return text, head, space, index, files, stores


def _reference(built, kind):
    text, head, space, index, files, _ = built
    deq = dequantised(files[kind])
    groups = space.load(index, deq)
    for i in KDA_LAYERS:                          # ssm_a = -exp(A_log), F32 in every file
        a = torch.from_numpy(deq[f"blk.{i}.ssm_a"].copy()).flatten()
        groups["text"][_a_log(i)] = torch.log(-a)
    n = sum(t.numel() for t in text.state_dict().values()) + head.weight.numel()
    skipped = [s for s in space.slots if s[1].endswith("A_log")]
    covered = space.covered.copy()
    for _, _, off, shape in skipped:
        covered[off:off + int(np.prod(shape))] = True
    assert covered[1:1 + n].all()                 # every transformers weight came from the file
    tx, hd = _with(text, groups["text"]), _with(head, groups["head"])
    return tx, _ref(tx, hd, TOKENS)


@pytest.fixture(scope="module")
def refs(built):
    return {k: _reference(built, k) for k in built[4]}


def test_the_files_have_the_types_asked_for(built):
    files = built[4]
    q8 = types_of(files["q8_0"])
    assert q8["blk.1.ffn_gate_exps.weight"] == "Q8_0" and q8["blk.0.ssm_a"] == "F32"
    assert q8["blk.0.hc_attn_fn.weight"] == q8["blk.1.ffn_gate_inp.weight"] == "F32"
    maya = types_of(files["maya-s"])
    assert {maya[f"blk.{i}.ffn_gate_exps.weight"] for i in (1, 2, 3, 4)} == {"IQ2_XXS"}
    assert {maya[f"blk.{i}.ffn_down_exps.weight"] for i in (1, 2, 3, 4)} == {"IQ2_S", "IQ3_XXS"}
    assert maya["blk.1.attn_kv_a_mqa.weight"] == maya["token_embd.weight"] == "Q6_K"
    assert maya["blk.0.attn_q.weight"] == maya["blk.1.indexer.attn_k.weight"] == "Q8_0"
    assert maya["blk.0.hc_attn_fn.weight"] == maya["blk.0.ssm_a"] == "F32"


def test_the_q8_0_file_holds_the_model_up_to_rounding(built):
    _, _, space, index, files, _ = built
    assert_q8_0_holds_the_model(space, index, files["q8_0"])


@pytest.mark.parametrize("kind", ["q8_0", "maya-s"])
def test_the_seed_gives_every_top_k_a_clear_gap(refs, kind):
    idx_gap, route_gap = _gaps(refs[kind][0], TOKENS)
    assert idx_gap > GAP and route_gap > GAP


@pytest.mark.parametrize("batch", [512, 5, 1], ids=["whole", "batches-of-5", "one-by-one"])
@pytest.mark.parametrize("kind", ["q8_0", "maya-s"])
def test_logits_equal_transformers_on_the_dequantised_weights(built, refs, kind, batch):
    ref = refs[kind][1]
    st = Store.open(built[5][kind])
    eng = Engine(st, DirectProvider(st, DEVICE), EngineOptions(
        device=DEVICE, dtype="float32", prefill_batch=batch))
    try:
        ours = eng.logits(TOKENS).numpy()
    finally:
        eng.close()
        st.close()
    d = np.abs(ours - ref).max()
    print(f"max |d| {kind} {batch}: {d:.3g}")
    assert ours.shape == ref.shape and d <= TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
