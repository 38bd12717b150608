"""expertfs.synth: files llama.cpp's loader would accept, checked against gguf-py.

Every architecture and every quant type is read back by gguf-py's ``GGUFReader`` and by our
``read_model``; metadata keys and types are checked per architecture against what llama.cpp's
loader reads; quantized tensors are dequantized by gguf-py and must be finite with about the
intended std. llama.cpp itself loads the files in test_llama_load.py (opt-in).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from gguf import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, GGUFReader, GGUFValueType, quants

from expertfs.cli import main
from expertfs.errors import UsageError
from expertfs.formats.ggml import GGMLType, row_bytes
from expertfs.formats.gguf_read import read_gguf
from expertfs.formats.gguf_split import read_model
from expertfs.formats.moe_names import is_expert_tensor
from expertfs.synth import (ARCHES, MIXED_TYPES, SUPPORTED_TYPES, SynthConfig, build_model,
                            build_vocab, estimate_bytes, layers_for_size, make_blocks, parse_quant,
                            synthesize)
from expertfs.synth.quant import PRESETS, Role, fallback_type
from expertfs.synth.tokenizer import bytes_to_unicode

V = GGUFValueType
T = GGMLType


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("synth")
    return {a: Path(synthesize(SynthConfig.tiny(a), d / f"{a}.gguf")[0]) for a in ARCHES}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[SynthConfig, Path]:
    cfg = SynthConfig.tiny("qwen3moe", n_layers=8, quant="mixed", n_vocab=768)
    return cfg, Path(synthesize(cfg, tmp_path_factory.mktemp("mixed") / "m.gguf")[0])


def _field(r: GGUFReader, key: str):
    f = r.fields[key]
    return f.types, f.contents()


def _known_names(arch: str) -> set[str] | None:
    """The arch's tensor names in the pinned gguf-py; None for an arch it predates (glm5-next:
    test_converter_parity checks it against the converter's own gguf-py)."""
    enum = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    return None if enum is None else {TENSOR_NAMES[t] for t in MODEL_TENSORS[enum]}


def _generic(name: str) -> str:
    parts = name.split(".")[:-1]                     # drop .weight/.bias
    if parts[0] == "blk":
        parts[1] = "{bid}"
    return ".".join(parts)


# ---- architectures ------------------------------------------------------------------------

# ids are not bare arch names: conftest skips every test with a "llama" keyword unless opted in
ARCH_IDS = [f"{a}-arch" for a in ARCHES]


@pytest.mark.parametrize("arch", ARCHES, ids=ARCH_IDS)
def test_arch_reads_back_with_gguf_py_and_read_model(tiny, arch):
    cfg = SynthConfig.tiny(arch)
    model = build_model(cfg)
    r = GGUFReader(tiny[arch])
    m = read_model(str(tiny[arch]))
    assert m.shards[0].canonical, "offsets must be llama.cpp's packed running sum"
    assert [t.name for t in r.tensors] == [p.name for p in model.plans] == [t.name for t in m.tensors]
    names = _known_names(arch)
    for rt, mt, p, ty in zip(r.tensors, m.tensors, model.plans, model.types):
        assert tuple(int(x) for x in rt.shape) == p.ne == mt.ne
        assert GGMLType(rt.tensor_type) == ty == mt.ggml_type
        assert rt.data_offset == mt.data_start and mt.data_start % 32 == 0
        assert names is None or _generic(p.name) in names, f"{p.name} is not a {arch} tensor"
        if p.name.endswith(".bias") or p.ne == (p.ne[0],) or "_norm" in p.name or "gate_inp" in p.name:
            assert ty == T.F32, f"{p.name} must be F32 as the converter writes it"
    assert r.fields["general.architecture"].contents() == arch
    assert m.total_bytes == estimate_bytes(cfg) == tiny[arch].stat().st_size


def test_tensor_order_and_shapes_qwen3moe(tiny):
    m = read_model(str(tiny["qwen3moe"]))
    names = [t.name for t in m.tensors]
    assert names[0] == "token_embd.weight" and names[-2:] == ["output_norm.weight", "output.weight"]
    assert names[1:13] == [
        "blk.0.attn_norm.weight", "blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight",
        "blk.0.ffn_up_exps.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_norm.weight",
        "blk.0.attn_k_norm.weight", "blk.0.attn_k.weight", "blk.0.attn_output.weight",
        "blk.0.attn_q_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight"]
    by = m.by_name
    assert by["blk.1.ffn_gate_exps.weight"].ne == (256, 256, 8)
    assert by["blk.1.ffn_down_exps.weight"].ne == (256, 256, 8)
    assert by["blk.1.attn_k.weight"].ne == (256, 128)          # n_embd, head_dim * n_head_kv
    assert by["blk.1.attn_q_norm.weight"].ne == (64,)
    assert by["token_embd.weight"].ne == (256, 1024)
    assert is_expert_tensor("blk.1.ffn_up_exps.weight", by["blk.1.ffn_up_exps.weight"].ne, 8)


def test_glm4moe_dense_lead_shexp_and_nextn_block(tiny):
    cfg = SynthConfig.tiny("glm4moe")
    m = read_model(str(tiny["glm4moe"]))
    by, E, F, X = m.by_name, cfg.n_embd, cfg.n_ff_exp, cfg.n_experts
    assert m.arch_value("block_count") == cfg.n_layers + 1 == 3
    assert m.arch_value("nextn_predict_layers") == 1
    assert "blk.0.ffn_gate.weight" in by and "blk.0.ffn_gate_exps.weight" not in by
    L = cfg.n_layers                                            # NextN block = block_count - 1
    for i in (1, L):
        assert by[f"blk.{i}.ffn_gate_exps.weight"].ne == (E, F, X)
        assert by[f"blk.{i}.exp_probs_b.bias"].ne == (X,)
        assert by[f"blk.{i}.ffn_gate_inp.weight"].ne == (E, X)
        assert by[f"blk.{i}.ffn_down_shexp.weight"].ne == (F, E)
        for b in ("q", "k", "v"):
            assert f"blk.{i}.attn_{b}.bias" in by
    assert by[f"blk.{L}.nextn.eh_proj.weight"].ne == (2 * E, E)
    for n in ("enorm", "hnorm", "shared_head_norm"):
        assert by[f"blk.{L}.nextn.{n}.weight"].ne == (E,)
    assert not any(".nextn." in n for n in by if not n.startswith(f"blk.{L}."))
    assert f"blk.{L}.nextn.embed_tokens.weight" not in by      # optional, off by default
    heads = build_model(SynthConfig.tiny("glm4moe", nextn_heads=True)).specs
    assert {s.name for s in heads} >= {f"blk.{L}.nextn.embed_tokens.weight",
                                       f"blk.{L}.nextn.shared_head_head.weight"}


def test_deepseek2_mla_and_fused_gate_up():
    cfg = SynthConfig.tiny("deepseek2", fuse_gate_up=True)
    by = {s.name: s for s in build_model(cfg).specs}
    h, kv = cfg.n_head, cfg.kv_lora_rank
    assert by["blk.1.attn_k_b.weight"].ne == (cfg.qk_nope_dim, kv, h)
    assert by["blk.1.attn_v_b.weight"].ne == (kv, cfg.v_head_dim, h)
    assert by["blk.1.attn_kv_a_mqa.weight"].ne == (cfg.n_embd, kv + cfg.qk_rope_dim)
    assert by["blk.1.attn_q_b.weight"].ne == (cfg.q_lora_rank, h * (cfg.qk_nope_dim + cfg.qk_rope_dim))
    assert by["blk.1.ffn_gate_up_exps.weight"].ne == (cfg.n_embd, 2 * cfg.n_ff_exp, cfg.n_experts)
    assert "blk.1.ffn_gate_exps.weight" not in by and "blk.1.ffn_up_exps.weight" not in by
    # k_b rows of 64 do not fit Q8_0? they do (32); a 256-block type falls back as llama-quantize
    assert fallback_type(T.Q4_K, 64) == T.Q5_0 and fallback_type(T.IQ2_XXS, 64) == T.IQ4_NL
    assert fallback_type(T.Q6_K, 2880) == T.Q8_0 and fallback_type(T.Q4_0, 48) == T.F16
    with pytest.raises(UsageError, match="ffn_gate_up_exps"):
        SynthConfig.tiny("qwen3moe", fuse_gate_up=True)


def test_gpt_oss_biases_and_sinks():
    cfg = SynthConfig.tiny("gpt-oss")
    by = {s.name: s for s in build_model(cfg).specs}
    assert by["blk.0.attn_sinks.weight"].ne == (cfg.n_head,)
    assert by["blk.0.ffn_gate_exps.bias"].ne == (cfg.n_ff_exp, cfg.n_experts)
    assert by["blk.0.ffn_down_exps.bias"].ne == (cfg.n_embd, cfg.n_experts)
    assert by["blk.0.ffn_gate_inp.bias"].ne == (cfg.n_experts,)
    assert by["blk.0.attn_output.bias"].ne == (cfg.n_embd,)
    assert by["blk.0.ffn_up_exps.weight"].ggml_type == T.MXFP4


# ---- metadata ------------------------------------------------------------------------------

_COMMON = {"block_count": V.UINT32, "context_length": V.UINT32, "embedding_length": V.UINT32,
           "feed_forward_length": V.UINT32, "attention.head_count": V.UINT32,
           "attention.head_count_kv": V.UINT32, "rope.freq_base": V.FLOAT32,
           "attention.layer_norm_rms_epsilon": V.FLOAT32, "expert_count": V.UINT32,
           "expert_used_count": V.UINT32}
_PER_ARCH = {
    "qwen3moe": {"attention.key_length": V.UINT32, "attention.value_length": V.UINT32,
                 "expert_feed_forward_length": V.UINT32},
    "glm4moe": {"rope.dimension_count": V.UINT32, "expert_feed_forward_length": V.UINT32,
                "expert_shared_count": V.UINT32, "leading_dense_block_count": V.UINT32,
                "expert_gating_func": V.UINT32, "expert_weights_scale": V.FLOAT32,
                "expert_weights_norm": V.BOOL, "nextn_predict_layers": V.UINT32,
                "expert_group_count": V.UINT32, "attention.key_length": V.UINT32},
    "llama": {"vocab_size": V.UINT32, "rope.dimension_count": V.UINT32},
    "deepseek2": {"attention.q_lora_rank": V.UINT32, "attention.kv_lora_rank": V.UINT32,
                  "attention.key_length_mla": V.UINT32, "attention.value_length_mla": V.UINT32,
                  "attention.key_length": V.UINT32, "leading_dense_block_count": V.UINT32,
                  "expert_shared_count": V.UINT32, "expert_gating_func": V.UINT32,
                  "expert_weights_norm": V.BOOL, "rope.dimension_count": V.UINT32,
                  "expert_feed_forward_length": V.UINT32, "vocab_size": V.UINT32},
    "gpt-oss": {"attention.sliding_window": V.UINT32, "expert_feed_forward_length": V.UINT32,
                "rope.scaling.type": V.STRING, "rope.scaling.factor": V.FLOAT32,
                "attention.key_length": V.UINT32},
    # None: a common key the arch does not have
    "glm5-next": {"attention.head_count_kv": V.ARRAY, "rope.freq_base": None,
                  "attention.indexer.types": V.ARRAY, "attention.indexer.kpool": V.UINT32,
                  "attention.indexer.kpool_select_tail": V.BOOL, "ssm.conv_kernel": V.UINT32,
                  "kda.head_dim": V.UINT32, "hyper_connection.count": V.UINT32,
                  "hyper_connection.epsilon": V.FLOAT32, "swiglu_clamp_exp": V.ARRAY,
                  "attention.layer_norm_epsilon": V.FLOAT32, "nextn_predict_layers": V.UINT32,
                  "attention.key_length_mla": V.UINT32, "rope.dimension_count": V.UINT32},
    "glm-dsa": {"attention.indexer.head_count": V.UINT32, "attention.indexer.top_k": V.UINT32,
                "attention.indexer.types": V.ARRAY, "attention.q_lora_rank": V.UINT32,
                "attention.key_length_mla": V.UINT32, "nextn_predict_layers": V.UINT32,
                "rope.dimension_count": V.UINT32, "expert_shared_count": V.UINT32},
}
_PRE = {"qwen3moe": "qwen2", "glm4moe": "glm4", "llama": "llama-bpe", "deepseek2": "deepseek-v3",
        "gpt-oss": "gpt-4o", "glm5-next": "glm4", "glm-dsa": "glm4"}


@pytest.mark.parametrize("arch", ARCHES, ids=ARCH_IDS)
def test_metadata_keys_and_types(tiny, arch):
    m = read_model(str(tiny[arch]))
    want = {f"{arch}.{k}": t for k, t in {**_COMMON, **_PER_ARCH[arch]}.items() if t is not None}
    want.update({"general.architecture": V.STRING, "general.name": V.STRING,
                 "general.file_type": V.UINT32, "general.quantization_version": V.UINT32,
                 "tokenizer.ggml.model": V.STRING, "tokenizer.ggml.pre": V.STRING,
                 "tokenizer.ggml.eos_token_id": V.UINT32, "tokenizer.chat_template": V.STRING})
    for key, vt in want.items():
        assert key in m.kv, f"{key} missing"
        assert m.kv[key].vtype == vt, f"{key} is {m.kv[key].vtype.name}, llama.cpp wants {vt.name}"
    for key, sub in (("tokens", V.STRING), ("token_type", V.INT32), ("merges", V.STRING)):
        e = m.kv[f"tokenizer.ggml.{key}"]
        assert e.vtype == V.ARRAY and e.subtype == sub
    cfg = SynthConfig.tiny(arch)
    assert len(m.value("tokenizer.ggml.tokens")) == cfg.n_vocab == m.by_name["token_embd.weight"].ne[1]
    assert m.value("tokenizer.ggml.model") == "gpt2" and m.value("tokenizer.ggml.pre") == _PRE[arch]
    assert "general.alignment" not in m.kv and list(m.kv)[0] == "general.architecture"
    assert list(m.kv)[-1] == "general.quantization_version"
    if arch == "glm4moe":
        assert m.arch_value("expert_gating_func") == 2 and m.arch_value("rope.dimension_count") == 32
    if arch == "deepseek2":
        assert m.arch_value("attention.key_length") == cfg.kv_lora_rank + cfg.qk_rope_dim
        assert m.arch_value("attention.head_count_kv") == 1


def test_tokenizer_is_valid_byte_level_bpe():
    v = build_vocab("qwen3moe", 1024)
    b2u = bytes_to_unicode()
    assert list(v.tokens[:256]) == list(b2u.values()) and len(set(v.tokens[:256])) == 256
    ids = {t: i for i, t in enumerate(v.tokens)}
    assert 250 <= len(v.merges) <= 400
    for m in v.merges:
        a, b = m.split(" ")
        assert a in ids and b in ids and a + b in ids
    specials = {t: v.token_types[ids[t]] for t, _ in v.family.specials}
    assert specials["<|im_end|>"] == 3 and specials["<think>"] == 4
    assert v.tokens[-1] == "[PAD1023]" and v.token_types[-1] == 5
    assert build_vocab("qwen3moe", 1024) == v                     # deterministic
    with pytest.raises(UsageError, match="vocabulary"):
        build_vocab("glm4moe", 260)


@pytest.mark.parametrize("arch", ARCHES, ids=ARCH_IDS)
def test_chat_template_renders(arch):
    jinja2 = pytest.importorskip("jinja2")
    v = build_vocab(arch, 1024)
    fam = v.family
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Zen?"}]
    text = jinja2.Template(fam.template).render(messages=msgs, add_generation_prompt=True,
                                                bos_token=fam.bos or "", eos_token=fam.eos)
    assert "Zen?" in text and "\\n" not in text
    used = [t for t, _ in fam.specials if t in text]
    assert used and all(t in v.tokens for t in used)


# ---- quant types ---------------------------------------------------------------------------

@pytest.mark.parametrize("t", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_to_intended_std(t):
    rng = np.random.default_rng(int(t))
    for sigma in (1 / math.sqrt(256), 1 / math.sqrt(7168)):
        w = quants.dequantize(make_blocks(t, 512, sigma, rng), t)
        assert np.isfinite(w).all()
        assert 0.85 < w.std() / sigma < 1.2, f"{t.name}: std {w.std() / sigma:.2f} sigma"
        assert abs(w.mean()) < 0.1 * sigma


def test_mixed_preset_covers_every_type_in_experts_and_trunk(mixed):
    cfg, path = mixed
    model = build_model(cfg)
    exp = {t for t, p in zip(model.types, model.plans) if p.role in (Role.EXPERTS, Role.DOWN)}
    trunk = {t for t, p in zip(model.types, model.plans) if p.role not in (Role.EXPERTS, Role.DOWN, Role.F32)}
    assert exp == set(MIXED_TYPES) and trunk == set(MIXED_TYPES) == set(SUPPORTED_TYPES)
    r = GGUFReader(path)
    m = read_model(str(path))
    assert m.shards[0].canonical and m.value("general.file_type") == 1024   # GUESSED
    for rt, p in zip(r.tensors, model.plans):
        t = GGMLType(rt.tensor_type)
        data = np.asarray(rt.data)
        w = data if t in (T.F32, T.F16) else quants.dequantize(data.view(np.uint8), t)
        assert np.isfinite(w).all(), rt.name
        if p.init.value == "weight":
            assert 0.8 < w.std() / p.sigma < 1.25, (rt.name, t.name, w.std() / p.sigma)
            assert abs(w.mean()) < 0.15 * p.sigma, (rt.name, t.name)


def test_quant_spec_parsing():
    s = parse_quant("experts=Q4_K,down=Q6_K,attn=Q8_0,embd=Q6_K,output=Q6_K")
    assert s.role_type(Role.EXPERTS) == T.Q4_K and s.role_type(Role.DOWN) == T.Q6_K
    assert parse_quant("IQ2_XXS").role_type(Role.ATTN) == T.IQ2_XXS
    assert parse_quant("q3_k_m").role_type(Role.EXPERTS) == T.Q3_K
    assert not set(PRESETS) & {t.name.lower() for t in SUPPORTED_TYPES}     # no ambiguity
    assert parse_quant("mixed,attn=Q8_0").mixed and parse_quant("mixed,attn=Q8_0").role_type(Role.ATTN) == T.Q8_0
    for bad in ("Q8_1", "experts=TQ1_0", "nonsense=Q4_K", "Q9_9"):
        with pytest.raises(UsageError):
            parse_quant(bad)


# ---- writing: split, determinism, pools ----------------------------------------------------

def _tensor_bytes(paths) -> dict[str, bytes]:
    out = {}
    for p in paths:
        f = read_gguf(p)
        raw = Path(p).read_bytes()
        out.update({t.name: raw[t.data_start:t.data_start + t.nbytes] for t in f.tensors})
    return out


def test_split_round_trip(tmp_path):
    cfg = SynthConfig.tiny("glm4moe")
    one = synthesize(cfg, tmp_path / "one.gguf")
    paths = synthesize(cfg, tmp_path / "m.gguf", split_max_bytes=600_000)
    n = len(paths)
    assert n > 2 and [Path(p).name for p in paths] == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    m = read_model(paths[0])
    assert [t.name for t in m.tensors] == [t.name for t in read_model(one[0]).tensors]
    for i, p in enumerate(paths):
        f = read_gguf(p)
        assert f.canonical
        assert f.kv["split.no"].vtype == V.UINT16 and f.value("split.no") == i
        assert f.kv["split.count"].vtype == V.UINT16 and f.value("split.count") == n
        assert f.kv["split.tensors.count"].vtype == V.INT32 and f.value("split.tensors.count") == len(m.tensors)
        if i:
            assert set(f.kv) == {"split.no", "split.count", "split.tensors.count"}
        assert sum(t.nbytes for t in f.tensors) <= 600_000 or len(f.tensors) == 1
    assert GGUFReader(paths[1]).tensors                              # gguf-py reads shards too
    assert _tensor_bytes(paths) == _tensor_bytes(one)
    assert len(synthesize(cfg, tmp_path / "big.gguf", split_max_bytes=1 << 30)) == 1


def _sha(p) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def test_deterministic_from_seed(tmp_path):
    cfg = SynthConfig.tiny("qwen3moe", seed=7)
    a = synthesize(cfg, tmp_path / "a.gguf")[0]
    b = synthesize(cfg, tmp_path / "b.gguf")[0]
    c = synthesize(cfg.replace(seed=8), tmp_path / "c.gguf")[0]
    assert _sha(a) == _sha(b) != _sha(c)
    ta, tc = _tensor_bytes([a]), _tensor_bytes([c])
    assert all(ta[k] != tc[k] for k in ta)
    # bytes are keyed by tensor name: a deeper model shares its first layers
    d = synthesize(cfg.with_layers(3), tmp_path / "d.gguf")[0]
    td = _tensor_bytes([d])
    assert all(td[k] == v for k, v in ta.items() if k.startswith("blk."))


@pytest.mark.parametrize("qt", [T.Q8_0, T.MXFP4, T.Q4_K, T.F16])
def test_large_tensor_paths_give_every_expert_distinct_bytes(tmp_path, qt):
    cfg = SynthConfig.tiny("qwen3moe", n_layers=1, n_experts=16, quant=f"experts={qt.name},down={qt.name}")
    p = synthesize(cfg, tmp_path / "p.gguf", pool_min_bytes=0)[0]     # every tensor via the pool
    m = read_model(p)
    raw = Path(p).read_bytes()
    t = m.by_name["blk.0.ffn_up_exps.weight"]
    per = t.nbytes // 16
    experts = [raw[t.data_start + e * per:t.data_start + (e + 1) * per] for e in range(16)]
    assert len(set(experts)) == 16
    w = np.frombuffer(experts[3], np.uint8).reshape(cfg.n_ff_exp, row_bytes(qt, cfg.n_embd))
    w = w.view(np.float16).astype(np.float32) if qt == T.F16 else quants.dequantize(w, qt)
    assert np.isfinite(w).all() and 0.85 < w.std() * math.sqrt(cfg.n_embd) < 1.2


def test_refuses_to_overwrite(tmp_path):
    p = synthesize(SynthConfig(), tmp_path / "x.gguf")[0]
    with pytest.raises(UsageError, match="exists"):
        synthesize(SynthConfig(), p)
    assert synthesize(SynthConfig(seed=1), p, overwrite=True) == [p]
    assert not list(tmp_path.glob("*.partial"))


def test_failure_while_writing_leaves_nothing_behind(tmp_path, monkeypatch):
    from expertfs.synth import data

    def broken(self, plan, t):
        yield np.zeros(16, np.uint8)
        raise RuntimeError("generator broke")

    monkeypatch.setattr(data.TensorData, "chunks", broken)
    with pytest.raises(RuntimeError, match="generator broke"):
        synthesize(SynthConfig(), tmp_path / "x.gguf")
    monkeypatch.undo()
    real = data.TensorData.chunks

    def short_output(self, plan, t):                            # shard 1 of 3 fails late
        return iter([np.zeros(4, np.uint8)]) if plan.name == "output.weight" else real(self, plan, t)

    monkeypatch.setattr(data.TensorData, "chunks", short_output)
    with pytest.raises(ValueError, match="expected"):
        synthesize(SynthConfig(), tmp_path / "x.gguf", split_max_bytes=1 << 20)
    assert list(tmp_path.iterdir()) == []


# ---- --like and --size ---------------------------------------------------------------------

def test_like_geometry():
    q = SynthConfig.like("qwen3-30b-a3b")
    assert (q.arch, q.n_layers, q.n_embd, q.n_ff_exp, q.n_experts, q.n_expert_used, q.head_dim,
            q.n_head, q.n_head_kv, q.n_vocab) == ("qwen3moe", 48, 2048, 768, 128, 8, 128, 32, 4, 151936)
    g = SynthConfig.like("GLM-4.5-Air", layers=4)
    assert (g.n_layers, g.block_count, g.n_dense_lead, g.n_experts, g.n_ff_exp, g.n_expert_shared,
            g.rope_dim) == (4, 5, 1, 128, 1408, 1, 64)
    assert SynthConfig.like("GLM-4.5", layers=2).n_dense_lead == 1        # keeps a MoE layer
    d = SynthConfig.like("DeepSeek-V3")
    assert (d.n_experts, d.expert_group_count, d.kv_lora_rank, d.n_dense_lead, d.n_nextn) == (256, 8, 512, 3, 0)
    assert SynthConfig.like("gpt-oss-120b").n_experts == 128
    assert SynthConfig.like("Mixtral-8x7B").arch == "llama"
    with pytest.raises(UsageError, match="not a known model"):
        SynthConfig.like("llama-7b")
    with pytest.raises(UsageError, match="V2-Lite"):
        SynthConfig.like("DeepSeek-V3", layers=27)
    # 8 groups of one expert: a group is scored by its two best, and 4 kept groups hold 4 < 8
    with pytest.raises(UsageError, match="at least 16 experts"):
        SynthConfig.like("DeepSeek-V3", layers=4, n_experts=8)


# sizes of the real files (Q4_K_M from the usual GGUF publishers; gpt-oss: ggml-org's MXFP4)
_REAL_GB = {"Qwen3-30B-A3B": 18.6, "Qwen3-235B-A22B": 142.6, "GLM-4.5-Air": 73.0, "GLM-4.5": 217.0,
            "gpt-oss-20b": 12.1, "gpt-oss-120b": 63.4, "Mixtral-8x7B": 28.4, "DeepSeek-V3": 404.0}


@pytest.mark.parametrize("name", list(_REAL_GB))
def test_full_size_estimates_match_real_quantized_files(name):
    # the default spec is a little heavier than Q4_K_M (every ffn_down in Q6_K, attention Q8_0)
    assert 0.97 < estimate_bytes(SynthConfig.like(name)) / (_REAL_GB[name] * 1e9) < 1.15


def test_layers_for_size():
    cfg = SynthConfig.tiny("glm4moe")
    picked = layers_for_size(cfg, 12 << 20)
    assert estimate_bytes(picked) <= 12 << 20 < estimate_bytes(picked.with_layers(picked.n_layers + 1))
    assert layers_for_size(cfg, 1).n_layers == 1


# ---- CLI -----------------------------------------------------------------------------------

def test_cli(tmp_path, capsys):
    out = tmp_path / "demo.gguf"
    assert main(["synth", "-o", str(out)]) == 0 and out.exists()
    capsys.readouterr()
    assert main(["synth", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "exists" in err and "--force" in err
    assert main(["synth", "-o", str(out), "--force", "--json", "--arch", "llama", "--experts", "6",
                 "--top-k", "3", "--seed", "5", "--quant", "down=Q8_0"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["paths"] == [str(out)] and res["config"]["n_experts"] == 6
    m = read_model(str(out))
    assert m.arch == "llama" and m.arch_value("expert_used_count") == 3
    assert m.by_name["blk.0.ffn_down_exps.weight"].ggml_type == T.Q8_0
    assert main(["synth", "-o", str(tmp_path / "s.gguf"), "--arch", "qwen3moe", "--size", "6M",
                 "--json"]) == 0
    assert Path(json.loads(capsys.readouterr().out)["paths"][0]).stat().st_size <= 6 << 20
    assert main(["synth", "-o", str(tmp_path / "sp.gguf"), "--split-max-size", "1M"]) == 0
    assert (tmp_path / "sp-00001-of-00003.gguf").exists()
    capsys.readouterr()
    for bad in (["--like", "nope"], ["--quant", "experts=Q9"], ["--top-k", "99"],
                ["--like", "GLM-4.5-Air", "--arch", "llama"], ["--fuse-gate-up"]):
        assert main(["synth", "-o", str(tmp_path / "bad.gguf"), *bad]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
