"""synth's glm5-next and glm-dsa files against llama.cpp's own converter.

For the tiny config of each architecture, a random transformers model of the same geometry is
converted by ``convert_hf_to_gguf.py`` (``--outtype q8_0``, in a child process: see
``llamacpp_ref.py``); synth's ``quant=Q8_0`` file must have exactly the converter's tensors (names,
ggml shapes, types, the order inside each block) and its metadata keys with the same value types,
values and order. Tokenizer keys and the converter's naming keys (``general.name``,
``general.size_label``) are left out: the tiny tokenizers differ by design.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from expertfs.synth import SynthConfig, synthesize

from llamacpp_ref import build_glm5_next, build_glm_dsa, convert, llamacpp_dir, read_layout

_SKIP_KEYS = ("general.name", "general.size_label", "general.type")

pytestmark = pytest.mark.skipif(llamacpp_dir() is None, reason=(
    "llama-cpp-python 0.3.36 sdist missing (~/.cache/expertfs/llama_cpp_python-0.3.36/vendor/"
    "llama.cpp): pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36"))


def _common(c: SynthConfig) -> dict:
    n = c.n_layers
    return dict(vocab_size=c.n_vocab, hidden_size=c.n_embd, intermediate_size=c.n_ff,
                moe_intermediate_size=c.n_ff_exp, num_hidden_layers=n,
                num_attention_heads=c.n_head, num_key_value_heads=c.n_head,
                n_shared_experts=c.n_expert_shared, n_routed_experts=c.n_experts,
                num_experts_per_tok=c.n_expert_used, kv_lora_rank=c.kv_lora_rank,
                q_lora_rank=c.q_lora_rank, qk_rope_head_dim=c.qk_rope_dim,
                v_head_dim=c.v_head_dim, qk_nope_head_dim=c.qk_nope_dim,
                index_topk=c.indexer_top_k, index_head_dim=c.indexer_head_dim,
                index_n_heads=c.indexer_heads, rms_norm_eps=c.rms_eps,
                max_position_embeddings=c.n_ctx_train,
                routed_scaling_factor=c.expert_weights_scale,
                mlp_layer_types=["sparse" if c.is_moe_block(i) else "dense" for i in range(n)],
                indexer_types=["full" if c.indexer_full(i) else "shared" for i in range(n)])


def _hf_glm5_next(c: SynthConfig) -> dict:
    return dict(_common(c), index_kpool=c.indexer_kpool, linear_head_dim=c.kda_head_dim,
                linear_num_heads=c.n_head, linear_conv_kernel_dim=c.ssm_conv_kernel,
                linear_lower_bound=c.kda_gate_lower_bound, hc_mult=c.hc_mult,
                hc_sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps,
                swiglu_limit=c.swiglu_limit, pad_token_id=0,
                layer_types=["linear_attention" if c.is_kda_block(i) else "indexed_attention"
                             for i in range(c.n_layers)])


def _hf_glm_dsa(c: SynthConfig) -> dict:
    return dict(_common(c), first_k_dense_replace=c.n_dense_lead,
                rope_parameters=dict(rope_type="default", rope_theta=c.rope_freq_base))


def _blocks(tensors) -> dict[str, list]:
    """Tensors grouped by block (``""`` for the global ones), each group in file order."""
    out: dict[str, list] = {}
    for name, ne, t in tensors:
        key = ".".join(name.split(".")[:2]) if name.startswith("blk.") else ""
        out.setdefault(key, []).append((name, ne, t))
    return {k: (sorted(v) if k == "" else v) for k, v in out.items()}


def _kv(entries: dict) -> list[tuple]:
    out = []
    for k, e in entries.items():
        if k in _SKIP_KEYS or k.startswith("tokenizer."):
            continue
        v = e.value
        if hasattr(v, "tolist"):
            v = v.tolist()
        out.append((k, e.vtype.name, e.subtype.name if e.subtype else None, v))
    return out


def _same_value(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    return a == b


def _narrow(name: str, layers: int) -> SynthConfig:
    """A ``--like`` preset cut to ``layers`` with its per-layer structure (mHC, KDA heads, MLA
    ranks, indexer, schedules) kept and the widths that only scale the file narrowed."""
    return SynthConfig.like(name, layers=layers, quant="Q8_0").replace(
        n_embd=256, n_head=4, n_experts=8, n_vocab=512, n_ff=512, n_ff_exp=256).validate()


_CASES = {"glm5-next": lambda: SynthConfig.tiny("glm5-next", quant="Q8_0"),
          "glm-dsa": lambda: SynthConfig.tiny("glm-dsa", quant="Q8_0"),
          "GLM-5.3-Flash-4": lambda: _narrow("GLM-5.3-Flash", 4),
          "GLM-5.2-7": lambda: _narrow("GLM-5.2", 7)}


@pytest.fixture(scope="module", params=list(_CASES))
def pair(request, tmp_path_factory):
    cfg = _CASES[request.param]()
    arch = cfg.arch
    d = tmp_path_factory.mktemp(request.param.replace("-", "_").replace(".", "_"))
    if arch == "glm5-next":
        build_glm5_next(d / "hf", _hf_glm5_next(cfg))
    else:
        build_glm_dsa(d / "hf", _hf_glm_dsa(cfg))
    ref = convert(d / "hf", d / "ref.gguf", "q8_0")
    ours = Path(synthesize(cfg, d / "synth.gguf")[0])
    return arch, read_layout(ref), read_layout(ours)


def test_tensors_match_the_converter(pair):
    arch, (ref_t, _), (our_t, _) = pair
    ref, ours = _blocks(ref_t), _blocks(our_t)
    assert list(ours) == sorted(ref, key=lambda k: (k != "", int(k.split(".")[1]) if k else 0))
    for blk in ref:
        assert ours[blk] == ref[blk], f"{arch} {blk or 'global tensors'} differ"


def test_metadata_matches_the_converter(pair):
    arch, (_, ref_kv), (_, our_kv) = pair
    ref, ours = _kv(ref_kv), _kv(our_kv)
    assert [k for k, *_ in ours] == [k for k, *_ in ref], f"{arch}: keys or their order differ"
    for (k, t, s, v), (_, t2, s2, v2) in zip(ref, ours):
        assert (t, s) == (t2, s2), f"{k}: {t2}/{s2}, the converter writes {t}/{s}"
        assert _same_value(v, v2), f"{k}: {v2!r}, the converter writes {v!r}"
