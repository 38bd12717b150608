"""gpt-oss against transformers' GptOssForCausalLM, through llama.cpp's converter.

A tiny random model with every feature (sliding and full layers with a prompt three times the
window, per-head sinks, q/k/v/o, router and per-expert biases, a swiglu clamp that bites, YaRN
with a correction range that rounding would move) is saved with ``save_pretrained``, converted
by llama.cpp's own ``convert_hf_to_gguf.py`` (tools/llamacpp_convert.py), repacked and run by
the engine: F32 from the float checkpoint, and MXFP4 experts from a checkpoint in OpenAI's MXFP4
layout (``*_blocks`` / ``*_scales``, the converter's own repacking), compared with transformers
on the experts as gguf-py dequantises them. The seed gives every router top-k a clear gap.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from llamacpp_convert import ConverterUnavailable, convert, tiny_bpe_tokenizer

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.experts.direct import DirectProvider
from expertfs.store.reader import Store
from expertfs.store.repack import repack

pytestmark = pytest.mark.slow        # two conversions by llama.cpp's converter (child processes)

TOL = 1e-3
SEED = 0
WINDOW = 8
TOKENS = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(7)).tolist()
DEVICE = os.environ.get("EXPERTFS_TEST_DEVICE", "cpu")
GAP = 1e-4
SPECIALS = ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>")


def _config(**over):
    import transformers as tf
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}
    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
               num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=512,
               rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=rope,
               initializer_range=0.05)
    cfg.update(over)
    return tf.GptOssConfig(**cfg)


def _model(seed: int = SEED, **over):
    import transformers as tf
    torch.manual_seed(seed)
    m = tf.GptOssForCausalLM(_config(**over)).eval()
    with torch.no_grad():                 # norms, sinks, every bias not trivial; a clamp that bites
        for name, p in m.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):
                p.add_(0.2 * torch.randn_like(p))
        for layer in m.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(15.0)
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return m


def _ref(model, tokens=TOKENS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def _probe(model, tokens=TOKENS) -> tuple[float, float]:
    """The smallest router top-k gap and the share of clamped gate/up values, from
    transformers' own modules."""
    gaps, clamped = [], []

    def on_router(mod, args):
        x = args[0].reshape(-1, mod.hidden_dim)
        v = (x @ mod.weight.T + mod.bias).sort(-1, descending=True).values
        gaps.append(float((v[:, mod.top_k - 1] - v[:, mod.top_k]).min()))

    def on_experts(mod, args):
        x, idx = args[0], args[1]
        for e in idx.unique().tolist():
            rows = (idx == e).any(-1)
            gu = x[rows] @ mod.gate_up_proj[e] + mod.gate_up_proj_bias[e]
            g, u = gu[..., ::2], gu[..., 1::2]
            clamped.append(float(((g > mod.limit) | (u.abs() > mod.limit)).float().mean()))

    hooks = [h for layer in model.model.layers for h in (
        layer.mlp.router.register_forward_pre_hook(on_router),
        layer.mlp.experts.register_forward_pre_hook(on_experts))]
    try:
        _ref(model, tokens)
    finally:
        for h in hooks:
            h.remove()
    return min(gaps), float(np.mean(clamped))


def _hf_dir(d, model):
    hf = d / "hf"
    model.save_pretrained(hf)
    tiny_bpe_tokenizer(hf, model.config.vocab_size, SPECIALS)
    return hf


def _store(d, hf, name: str) -> str:
    try:
        gguf = convert(hf, d / f"{name}.gguf", outtype="f32", vocab_pre="gpt-4o")
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp's converter is unavailable: {e}")
    store = str(d / f"{name}.efs")
    repack([str(gguf)], store, force=True)
    return store


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss")
    model = _model()
    store = _store(d, _hf_dir(d, model), "model-F32")
    return model, store, _ref(model)


def _mxfp4_codes(g: torch.Generator, E: int, rows: int, cols: int, scale: tuple[int, int]):
    """Random MXFP4 ``blocks [E, rows, cols/32, 16]`` and ``scales [E, rows, cols/32]``."""
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(*scale, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def built_mxfp4(tmp_path_factory):
    """The model with its experts in OpenAI's MXFP4 checkpoint layout, converted as llama.cpp
    converts gpt-oss-20b/120b; the reference runs on the GGUF's experts dequantised by gguf-py."""
    import gguf
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    d = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = _model()
    hf = _hf_dir(d, model)
    st = hf / "model.safetensors"
    tensors = load_file(st)
    g = torch.Generator().manual_seed(11)
    c = model.config
    E, D, F = c.num_local_experts, c.hidden_size, c.intermediate_size
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}.mlp.experts."
        for n, rows, cols, scale in (("gate_up_proj", 2 * F, D, (124, 127)),
                                     ("down_proj", D, F, (119, 122))):
            del tensors[p + n]
            blocks, scales = _mxfp4_codes(g, E, rows, cols, scale)
            tensors[p + n + "_blocks"], tensors[p + n + "_scales"] = blocks, scales
            with torch.no_grad():        # transformers' own dequantisation, [E, in, out]
                getattr(layer.mlp.experts, n).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, st, metadata={"format": "pt"})
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (hf / "config.json").write_text(json.dumps(cfg))
    store = _store(d, hf, "model-MXFP4")
    r = gguf.GGUFReader(str(d / "model-MXFP4.gguf"))
    deq = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in r.tensors
           if t.tensor_type == gguf.GGMLQuantizationType.MXFP4}
    assert len(deq) == 3 * c.num_hidden_layers
    with torch.no_grad():                # the converter's bytes, as gguf-py reads them
        for i, layer in enumerate(model.model.layers):
            ex, p = layer.mlp.experts, f"blk.{i}."
            gate, up = deq[p + "ffn_gate_exps.weight"], deq[p + "ffn_up_exps.weight"]
            gu = np.stack((gate, up), axis=2).reshape(E, 2 * F, D)      # rows interleaved
            gguf_gu = torch.from_numpy(gu).transpose(1, 2)
            gguf_down = torch.from_numpy(deq[p + "ffn_down_exps.weight"]).transpose(1, 2)
            assert torch.equal(gguf_gu, ex.gate_up_proj) and torch.equal(gguf_down, ex.down_proj)
            ex.gate_up_proj.copy_(gguf_gu)
            ex.down_proj.copy_(gguf_down)
    return model, store, _ref(model)


def _ours(store: str, tokens=TOKENS, **opts) -> np.ndarray:
    from support.oracle import engine_logits
    return engine_logits(store, tokens, DEVICE, **opts)


def test_the_seed_gives_every_top_k_a_clear_gap_and_the_clamp_bites(built):
    gap, clamped = _probe(built[0])
    assert gap > GAP and 0.01 < clamped < 0.5


def test_every_feature_moves_the_logits(built):
    """The window, the sinks and YaRN's unrounded range each change transformers' logits by far
    more than the tolerance: the comparison below sees every one of them."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    model, _, ref = built
    d = np.abs(_ref(_model(sliding_window=512)) - ref).max(-1)
    assert d[:WINDOW].max() < 1e-5 and d[WINDOW + 1:].min() > 1e-2
    rounded = _model()
    rounded.config.rope_parameters["truncate"] = True
    rounded.model.rotary_emb = GptOssRotaryEmbedding(rounded.config)
    assert np.abs(_ref(rounded) - ref).max() > 10 * TOL
    saved = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    try:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        assert np.abs(_ref(model) - ref).max() > 10 * TOL
    finally:
        with torch.no_grad():
            for layer, s in zip(model.model.layers, saved):
                layer.self_attn.sinks.copy_(s)


@pytest.mark.parametrize("fused", ["off", "on"])
@pytest.mark.parametrize("batch", [512, 5, 1], ids=["whole", "batches-of-5", "one-by-one"])
def test_logits_equal_transformers(built, batch, fused):
    _, store, ref = built
    ours = _ours(store, prefill_batch=batch, fused=fused)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("fused", ["off", "on"])
@pytest.mark.parametrize("batch", [512, 5, 1], ids=["whole", "batches-of-5", "one-by-one"])
def test_mxfp4_experts_equal_transformers(built_mxfp4, batch, fused):
    """The converter's MXFP4 experts, multiplied from their bytes (the native kernels' MXFP4
    products where they are built; ``off``: the torch products, the path CUDA takes), against
    transformers on the same values."""
    from expertfs.formats.ggml import GGMLType
    model, store, ref = built_mxfp4
    gap, clamped = _probe(model)
    assert gap > GAP and 0.01 < clamped < 0.5
    with Store.open(store) as st:
        p = DirectProvider(st, "cpu")
        types = {q.ggml_type for q in p.get(0, [0])[0].parts.values()}
        p.release(0)
    assert GGMLType.MXFP4 in types
    ours = _ours(store, prefill_batch=batch, fused=fused)
    assert np.abs(ours - ref).max() <= TOL


def test_decode_takes_the_one_call_native_layer_product(built_mxfp4, monkeypatch):
    """One token's biased, ``swiglu_oai`` experts go through the native layer product (one call
    a layer), not one expert at a time in Python, where the kernels are built."""
    from expertfs.runtime import kernels
    from expertfs.runtime.model import moe
    if not kernels.available():
        pytest.skip("native kernels not built here")
    calls = {"native": 0, "per_expert": 0}
    real_moe, real_ffn = kernels.moe, moe.expert_ffn

    def spy_moe(*a, **k):
        calls["native"] += 1
        return real_moe(*a, **k)

    def spy_ffn(x, *a, **k):
        calls["per_expert"] += x.shape[0] == 1
        return real_ffn(x, *a, **k)
    monkeypatch.setattr(kernels, "moe", spy_moe)
    monkeypatch.setattr(moe, "expert_ffn", spy_ffn)
    _, store, ref = built_mxfp4
    ours = _ours(store, prefill_batch=1, fused="on")
    assert np.abs(ours - ref).max() <= TOL
    assert calls["native"] > 0 and calls["per_expert"] == 0


def test_dequantized_expert_cache_keeps_the_biases(built):
    _, store, ref = built
    ours = _ours(store, prefill_batch=1, fused="on", dq_cache=1 << 24)
    assert np.abs(ours - ref).max() <= TOL


def test_rollback_and_continue(built):
    _, store, ref = built
    with Store.open(store) as st:
        eng = Engine(st, DirectProvider(st, DEVICE),
                     EngineOptions(device=DEVICE, dtype="float32", fused="off"))
        try:
            eng.logits(TOKENS[:20])
            eng.reset(11)
            tail = eng.logits(TOKENS[11:], reset=False).numpy()
        finally:
            eng.close()
    assert np.abs(tail - ref[11:]).max() <= TOL


def test_config_as_llama_cpp_reads_it(built):
    from expertfs.runtime.model.config import GATING_SOFTMAX_WEIGHT
    _, store, _ = built
    with Engine.open(store, provider="direct", device=DEVICE, dtype="float32") as eng:
        cfg = eng.config
        assert (cfg.arch, cfg.n_layers, cfg.ext.window) == ("gpt-oss", 4, WINDOW)
        assert cfg.gating == GATING_SOFTMAX_WEIGHT and not cfg.norm_w and not cfg.w_scale
        assert cfg.rope_yarn and not cfg.yarn_truncate and cfg.rope_freq_scale == 0.25
        blk = eng.trunk.blocks[0]
        assert blk.moe.router.bias is not None and blk.moe.alpha == 1.702
        assert blk.moe.limit == 7.0 and blk.attn.sinks.shape == (4,)


def test_bad_window_is_a_typed_error(built):
    from expertfs.errors import UnsupportedModelError
    from expertfs.runtime.model.config import ModelConfig
    with Store.open(built[1]) as st:
        kv = dict(st.gguf_kv())
    kv.pop("gpt-oss.attention.sliding_window")
    with pytest.raises(UnsupportedModelError, match="sliding_window") as e:
        ModelConfig.from_gguf(kv, path="model.gguf")
    assert "convert_hf_to_gguf" in str(e.value)


def _full_cache(monkeypatch):
    """Sliding layers with a ring as long as the context: the whole-context cache."""
    from expertfs.runtime.model.archs import gpt_oss
    monkeypatch.setattr(gpt_oss, "swa_ring", lambda window, n_ctx: n_ctx)


@pytest.mark.parametrize("batch", [12, 5, 1], ids=["batches-of-12", "batches-of-5", "one-by-one"])
def test_ring_cache_equals_the_whole_context_cache(built, batch, monkeypatch):
    """The sliding layers' ring (two windows, wrapped: the prompt is three windows long) gives
    the logits of a cache of the whole context, bit for bit, one token at a time and in batches
    longer than the ring's spare positions."""
    _, store, ref = built
    with Store.open(store) as st:
        with Engine(st, DirectProvider(st, DEVICE),
                    EngineOptions(device=DEVICE, dtype="float32", fused="off")) as eng:
            assert eng.model.cache.k[0].shape[1] == 2 * WINDOW < len(TOKENS)
    ring = _ours(store, prefill_batch=batch)
    _full_cache(monkeypatch)
    full = _ours(store, prefill_batch=batch)
    assert np.array_equal(ring, full)
    assert np.abs(ring - ref).max() <= TOL


def test_kv_cache_bytes_at_ctx_as_the_plan_counts_them(built):
    from expertfs.runtime.plan.geometry import kv_cache_bytes
    from expertfs.runtime.plan.model import geometry_of_store
    _, store, _ = built
    with Store.open(store) as st:
        g = geometry_of_store(st)
        for n_ctx in (12, 4096):
            with Engine(st, DirectProvider(st, DEVICE), EngineOptions(
                    device=DEVICE, dtype="float32", fused="off", n_ctx=n_ctx)) as eng:
                eng.model.cache.reserve(n_ctx)
                assert eng.model.cache.nbytes == kv_cache_bytes(g, n_ctx, "f32")
        # full layers at the context, sliding ones at a ring of 2 windows and its 2 copies
        per = 2 * 16 * 2 * 4
        assert kv_cache_bytes(g, 4096, "f32") == 2 * per * 4096 + 2 * per * 3 * 2 * WINDOW


def test_rollback_past_the_ring_is_refused_and_a_prompt_end_is_kept(built):
    """Going back more than the ring holds is refused (the server then prefills again); the
    checkpoint taken one window after a prompt's end lets a later request go back there."""
    from expertfs.errors import UsageError
    _, store, ref = built
    with Store.open(store) as st:
        with Engine(st, DirectProvider(st, DEVICE),
                    EngineOptions(device=DEVICE, dtype="float32", fused="off")) as eng:
            eng.logits(TOKENS)
            assert eng.can_reset(0) and eng.can_reset(len(TOKENS) - 2 * WINDOW + WINDOW - 1)
            assert not eng.can_reset(3)
            with pytest.raises(UsageError, match="cannot go back"):
                eng.reset(3)
            eng.reset()
            eng.prefill(TOKENS[:10])
            for t in TOKENS[10:]:
                eng.decode(t)
            assert eng.can_reset(11) and eng.can_reset(9) and not eng.can_reset(8)
            eng.reset(11)
            tail = eng.logits(TOKENS[11:], reset=False).numpy()
    assert np.abs(tail - ref[11:]).max() <= TOL


@pytest.mark.parametrize("batch", [512, 1], ids=["whole", "one-by-one"])
def test_bfloat16_as_cuda_runs_it(built, batch):
    """The compute dtype CUDA defaults to (bfloat16 matrices and KV cache, float32 sinks,
    biases, scores and residual), on the torch paths: transformers' top-1 at every position."""
    _, store, ref = built
    with Store.open(store) as st:
        with Engine(st, DirectProvider(st, DEVICE), EngineOptions(
                device=DEVICE, dtype="bfloat16", fused="off", prefill_batch=batch)) as eng:
            ours = eng.logits(TOKENS).numpy()
            cache, att = eng.model.cache, eng.model.attend
            assert {t.dtype for t in cache.k + cache.v} == {torch.bfloat16}
            assert {t.device.type for c in att.ckpts for t in c.k + c.v} == {torch.device(DEVICE).type}
            assert eng.trunk.blocks[0].attn.sinks.dtype == torch.float32
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    assert np.median(np.abs(ours - ref)) < 0.05
