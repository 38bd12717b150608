"""The GLM-5 family in synth: the GLM-5.3-Flash and GLM-5.2 presets, the Maya-S mix, and random
weights that a forward can run on (norms near 1, valid mHC mixing and KDA decay)."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, LlamaFileType

from expertfs.cli import main
from expertfs.formats.ggml import GGMLType
from expertfs.formats.gguf_split import read_model
from expertfs.synth import SynthConfig, build_model, synthesize
from expertfs.synth.quant import use_more_bits

T = GGMLType

# llama.cpp src/models/glm-dsa.cpp GLM_5_2_DEFAULT_INDEXER_TYPES (GLM-5.2 config.json)
_GLM52_INDEXER = [1, 1] + [1, 0, 0, 0] * 19


def test_glm53_flash_geometry():
    c = SynthConfig.like("GLM-5.3-Flash")
    assert (c.arch, c.n_layers, c.block_count, c.n_dense_lead, c.n_experts, c.n_expert_shared,
            c.n_expert_used, c.n_embd, c.n_ff_exp, c.n_vocab) == \
        ("glm5-next", 45, 46, 3, 288, 1, 8, 4096, 2048, 154880)
    assert (c.n_head, c.kda_head_dim, c.ssm_conv_kernel, c.q_lora_rank, c.kv_lora_rank,
            c.qk_nope_dim, c.qk_rope_dim) == (64, 128, 4, 1536, 512, 256, 0)
    assert (c.indexer_heads, c.indexer_head_dim, c.indexer_top_k, c.indexer_kpool, c.hc_mult) == \
        (32, 128, 2048, 16, 4)
    kda = [c.is_kda_block(i) for i in range(c.block_count)]
    assert sum(kda) == 34 and kda[:4] == [True, True, True, False] and not kda[45]
    m = build_model(c).gguf_model()
    assert list(m.arch_value("attention.head_count_kv")) == [0 if k else 1 for k in kda]
    assert list(m.arch_value("swiglu_clamp_exp")) == [10.0] * 46
    names = {t.name for t in m.tensors}
    assert "blk.45.nextn.eh_proj.weight" in names and "blk.45.hc_attn_fn.weight" not in names
    assert "blk.0.ssm_a" in names and "blk.3.indexer_compressor_gate.weight" in names
    cut = SynthConfig.like("GLM-5.3-Flash", layers=4)
    assert (cut.n_layers, cut.n_dense_lead, cut.block_count) == (4, 3, 5)
    assert [cut.is_kda_block(i) for i in range(5)] == [True, True, True, False, False]


def test_glm52_geometry():
    c = SynthConfig.like("GLM-5.2")
    assert (c.arch, c.n_layers, c.block_count, c.n_embd, c.n_experts, c.n_dense_lead,
            c.q_lora_rank, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim) == \
        ("glm-dsa", 78, 79, 6144, 256, 3, 2048, 192, 64, 256)
    m = build_model(c).gguf_model()
    assert [int(x) for x in m.arch_value("attention.indexer.types")] == _GLM52_INDEXER
    assert m.value("glm-dsa.context_length") >= 1048576      # llama.cpp: GLM-5.2, not 5/5.1
    by = {t.name: t for t in m.tensors}
    assert "blk.3.indexer.attn_k.weight" not in by and "blk.6.indexer.attn_k.weight" in by
    assert by["blk.78.indexer.proj.weight"].ne == (6144, 32)               # NextN: full
    assert by["blk.5.attn_kv_a_mqa.weight"].ne == (6144, 512 + 64)


def test_maya_s_mix():
    c = SynthConfig.like("GLM-5.3-Flash", layers=16, quant="maya-s")
    model = build_model(c)
    seen = set()
    for p, t in zip(model.plans, model.types):
        n, i = p.name, int(p.name.split(".")[1]) if p.name.startswith("blk.") else -1
        if "_exps" in n:
            want = T.IQ2_XXS if "down" not in n else \
                (T.IQ3_XXS if use_more_bits(i, c.n_layers) else T.IQ2_S)
        elif any(k in n for k in ("hc_", "ssm_a", "ssm_dt", "ssm_conv1d", "exp_probs_b",
                                  "gate_inp", "indexer_compressor", "indexer.proj", "norm")):
            want = T.F32
        elif ".ssm_" in n or (c.is_kda_block(i) and ".attn_" in n) or ".indexer." in n:
            want = T.Q8_0
        else:                                          # MLA, shared expert, dense, embd, output
            want = T.Q6_K
        assert t == want, (n, t.name, want.name)
        seen.add(t)
    assert seen == {T.IQ2_XXS, T.IQ2_S, T.IQ3_XXS, T.Q6_K, T.Q8_0, T.F32}
    assert model.gguf_model().value("general.file_type") == LlamaFileType.MOSTLY_IQ2_XXS
    # rows that are not whole 256-blocks take llama-quantize's IQ4_NL fallback
    odd = build_model(SynthConfig.tiny("glm5-next", n_ff_exp=96, quant="maya-s"))
    down = dict(zip((p.name for p in odd.plans), odd.types))["blk.1.ffn_down_exps.weight"]
    assert down == T.IQ4_NL
    full = build_model(SynthConfig.like("GLM-5.3-Flash", quant="maya-s"))
    assert 0.9 < full.expert_bytes / full.data_bytes < 0.97


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def test_random_weights_are_numerically_sane(tmp_path):
    cfg = SynthConfig.tiny("glm5-next", quant="Q8_0")
    path = synthesize(cfg, tmp_path / "g.gguf")[0]
    w = {t.name: np.asarray(t.data, dtype=np.float32).reshape(t.data.shape)
         for t in GGUFReader(path).tensors if t.tensor_type == 0}
    for n, a in w.items():
        assert np.isfinite(a).all(), n
        if n.endswith("norm.weight"):
            assert abs(a.mean() - 1) < 0.05, n
    for i in range(cfg.n_layers):
        if cfg.is_kda_block(i):
            a = w[f"blk.{i}.ssm_a"]
            assert (a <= -1).all() and (a >= -16).all()
            g = cfg.kda_gate_lower_bound * _sigmoid(-a[:, None] * w[f"blk.{i}.ssm_dt.bias"]
                                                    .reshape(len(a), -1))
            assert np.isfinite(g).all() and (g <= 0).all() and (g >= cfg.kda_gate_lower_bound).all()
        # mHC: transformers' pre/post/comb from the stored fn/base/scale on a unit-RMS input
        hc, rng = cfg.hc_mult, np.random.default_rng(i)
        x = rng.standard_normal(hc * cfg.n_embd).astype(np.float32)
        x /= np.sqrt((x * x).mean())
        mix = w[f"blk.{i}.hc_attn_fn.weight"] @ x
        base, scale = w[f"blk.{i}.hc_attn_base.weight"], w[f"blk.{i}.hc_attn_scale.weight"]
        assert np.abs(mix).max() < 6 and np.abs(scale).max() < 0.2 and np.abs(base).max() < 0.2
        pre = _sigmoid(mix[:hc] * scale[0] + base[:hc])
        post = 2 * _sigmoid(mix[hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = np.exp(mix[2 * hc:] * scale[2] + base[2 * hc:]).reshape(hc, hc)
        for _ in range(cfg.hc_sinkhorn_iters):
            comb /= comb.sum(axis=-1, keepdims=True)
            comb /= comb.sum(axis=-2, keepdims=True)
        assert 0.4 < pre.min() and pre.max() < 0.6 and 0.8 < post.min() and post.max() < 1.2
        assert np.allclose(comb.sum(0), 1, atol=1e-3) and np.allclose(comb.sum(1), 1, atol=1e-3)


def test_cli_like_glm53_flash_and_inspect(tmp_path, capsys):
    out = tmp_path / "g.gguf"
    assert main(["synth", "-o", str(out), "--like", "GLM-5.3-Flash", "--layers", "4",
                 "--experts", "8", "--vocab", "512", "--quant", "maya-s"]) == 0
    m = read_model(str(out))
    assert m.arch == "glm5-next" and m.arch_value("block_count") == 5
    assert m.by_name["blk.4.ffn_gate_exps.weight"].ggml_type == T.IQ2_XXS
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "glm5-next" in text and "MoE layers: 1 (+1 NextN)" in text and "IQ2_XXS" in text
