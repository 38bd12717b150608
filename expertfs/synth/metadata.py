"""GGUF metadata of a synthetic model, written through gguf-py's own ``GGUFWriter.add_*``.

The keys, their value types and their order are the ones ``convert_hf_to_gguf`` produces for the
architecture: ``general.*``, the generic ``TextModel.set_gguf_parameters`` keys, the
architecture's own keys (LC ``conversion/{qwen,glm,llama,deepseek,gpt_oss}.py``; the GLM-5
family's ``GlmMoeDsaModel``/``Glm5NextModel``, its new keys written by name as the pinned gguf-py
has no ``add_*`` for them), the tokenizer
(``_set_vocab_gpt2`` + ``SpecialVocab``), and ``general.quantization_version`` last. Using
``GGUFWriter`` as the builder means every key has exactly the GGUF type the converter gives it.
"""

from __future__ import annotations

from functools import lru_cache

from gguf import GGML_QUANT_VERSION, ExpertGatingFuncType, GGUFValueType, GGUFWriter, RopeScalingType

from ..formats.gguf_write import encode_kv
from .config import SynthConfig
from .quant import file_type
from .tokenizer import build_vocab

__all__ = ["metadata_kv", "metadata_items"]

_GATING = {1: ExpertGatingFuncType.SOFTMAX, 2: ExpertGatingFuncType.SIGMOID}
_SCALING = {"yarn": RopeScalingType.YARN, "linear": RopeScalingType.LINEAR}


def _generic(w: GGUFWriter, c: SynthConfig) -> None:
    """``TextModel.set_gguf_parameters`` (LC conversion/base.py), in its order."""
    w.add_block_count(c.block_count)
    w.add_context_length(c.n_ctx_train)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(c.n_ff)
    w.add_head_count(c.n_head)
    if c.arch == "glm5-next":                       # 0 marks a KDA layer, 1 an MLA layer
        w.add_array(f"{c.arch}.attention.head_count_kv",
                    [0 if c.is_kda_block(i) else 1 for i in range(c.block_count)])
    else:
        w.add_head_count_kv(c.n_head_kv)
    if c.rope_scaling:
        w.add_rope_scaling_type(_SCALING[c.rope_scaling])
        w.add_rope_scaling_factor(c.rope_scaling_factor)
        if c.rope_scaling == "yarn":
            w.add_rope_scaling_orig_ctx_len(c.rope_orig_ctx)
            if c.yarn_beta_fast:
                w.add_rope_scaling_yarn_beta_fast(c.yarn_beta_fast)
            if c.yarn_beta_slow:
                w.add_rope_scaling_yarn_beta_slow(c.yarn_beta_slow)
    if c.arch != "glm5-next":                      # nope-only: no rope_theta in its config
        w.add_rope_freq_base(c.rope_freq_base)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_expert_count(c.n_experts)
    w.add_expert_used_count(c.n_expert_used)
    if c.expert_group_count:
        w.add_expert_group_count(c.expert_group_count)
        w.add_expert_group_used_count(c.expert_group_used_count)
    if c.arch == "deepseek2" and c.gating:         # HF scoring_func, read by the generic code
        w.add_expert_gating_func(_GATING[c.gating])
    if c.arch in ("qwen3moe", "glm4moe", "gpt-oss"):   # HF configs with head_dim
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if c.arch == "glm-dsa":                         # head_dim set before the generic keys
        w.add_key_length(c.kv_lora_rank + c.qk_rope_dim)
        w.add_value_length(c.kv_lora_rank)
    w.add_file_type(file_type(c.quant_spec))


def _arch(w: GGUFWriter, c: SynthConfig) -> None:
    if c.arch == "qwen3moe":                        # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(c.n_ff_exp)
    elif c.arch == "llama":                         # LlamaModel.set_gguf_parameters
        w.add_vocab_size(c.n_vocab)
        w.add_rope_dimension_count(c.head_dim)
    elif c.arch == "glm4moe":                       # Glm4MoeModel.set_gguf_parameters
        w.add_rope_dimension_count(c.rope_dim or c.head_dim // 2)
        # (the converter adds expert_count again here; gguf-py keeps the first position)
        w.add_expert_feed_forward_length(c.n_ff_exp)
        w.add_expert_shared_count(c.n_expert_shared)
        w.add_leading_dense_block_count(c.n_dense_lead)
        w.add_expert_gating_func(_GATING[c.gating or 2])
        if c.expert_weights_scale:
            w.add_expert_weights_scale(c.expert_weights_scale)
        if c.expert_weights_norm is not None:
            w.add_expert_weights_norm(c.expert_weights_norm)
        if c.n_nextn:
            w.add_nextn_predict_layers(c.n_nextn)
    elif c.arch == "deepseek2":                     # DeepseekV2Model.set_gguf_parameters
        w.add_leading_dense_block_count(c.n_dense_lead)
        w.add_vocab_size(c.n_vocab)
        if c.q_lora_rank:
            w.add_q_lora_rank(c.q_lora_rank)
        elif c.n_layers not in (26, 27):
            # llama.cpp reads a deepseek2 without q_lora as "lite" only at 26 or 27 layers and
            # otherwise requires the key: a cut of such a model states its 0
            w.add_q_lora_rank(0)
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_dim + c.qk_rope_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_expert_feed_forward_length(c.n_ff_exp)
        w.add_expert_shared_count(c.n_expert_shared)
        if c.expert_weights_scale:
            w.add_expert_weights_scale(c.expert_weights_scale)
        if c.expert_weights_norm:
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(c.qk_rope_dim)
        if c.yarn_log_mul:
            w.add_rope_scaling_yarn_log_mul(c.yarn_log_mul)
        if c.n_nextn:
            w.add_nextn_predict_layers(c.n_nextn)
    elif c.arch == "gpt-oss":                       # GptOssModel.set_gguf_parameters
        w.add_sliding_window(c.sliding_window)
        w.add_expert_feed_forward_length(c.n_ff_exp)
    elif c.arch == "glm-dsa":
        _glm_dsa(w, c)
    elif c.arch == "glm5-next":
        _glm5_next(w, c)


def _moe_dsa(w: GGUFWriter, c: SynthConfig) -> None:
    w.add_expert_feed_forward_length(c.n_ff_exp)
    w.add_expert_shared_count(c.n_expert_shared)
    if c.expert_weights_scale:
        w.add_expert_weights_scale(c.expert_weights_scale)
    if c.expert_weights_norm is not None:
        w.add_expert_weights_norm(c.expert_weights_norm)


def _indexer(w: GGUFWriter, c: SynthConfig) -> None:
    k = f"{c.arch}.attention.indexer"
    w.add_uint32(f"{k}.head_count", c.indexer_heads)
    w.add_uint32(f"{k}.key_length", c.indexer_head_dim)
    w.add_uint32(f"{k}.top_k", c.indexer_top_k)
    if c.arch == "glm5-next":
        w.add_uint32(f"{k}.kpool", c.indexer_kpool)
        w.add_bool(f"{k}.kpool_select_tail", True)
    w.add_array(f"{k}.types", [c.indexer_full(i) for i in range(c.n_layers)])


def _glm_dsa(w: GGUFWriter, c: SynthConfig) -> None:
    """GlmMoeDsaModel.set_gguf_parameters (DeepseekV2Model's keys, then rope, NextN, indexer)."""
    w.add_leading_dense_block_count(c.n_dense_lead)
    w.add_vocab_size(c.n_vocab)
    w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_dim + c.qk_rope_dim)
    w.add_value_length_mla(c.v_head_dim)
    _moe_dsa(w, c)
    w.add_rope_dimension_count(c.qk_rope_dim)
    if c.n_nextn:
        w.add_nextn_predict_layers(c.n_nextn)
    _indexer(w, c)


def _glm5_next(w: GGUFWriter, c: SynthConfig) -> None:
    """Glm5NextModel.set_gguf_parameters, in its order."""
    a = c.arch
    w.add_vocab_size(c.n_vocab)
    w.add_float32(f"{a}.attention.layer_norm_epsilon", 1e-6)
    if c.n_nextn:
        w.add_nextn_predict_layers(c.n_nextn)
    w.add_uint32(f"{a}.ssm.conv_kernel", c.ssm_conv_kernel)
    w.add_uint32(f"{a}.kda.head_dim", c.kda_head_dim)
    if c.kda_gate_lower_bound:
        w.add_float32(f"{a}.kda.gate_lower_bound", c.kda_gate_lower_bound)
    w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_rope_dimension_count(0)
    w.add_key_length(c.kv_lora_rank)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_dim)
    w.add_value_length_mla(c.v_head_dim)
    _indexer(w, c)
    w.add_uint32(f"{a}.hyper_connection.count", c.hc_mult)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", c.hc_sinkhorn_iters)
    w.add_float32(f"{a}.hyper_connection.epsilon", c.hc_eps)
    w.add_leading_dense_block_count(c.n_dense_lead)
    _moe_dsa(w, c)
    if c.swiglu_limit:
        w.add_array(f"{a}.swiglu_clamp_exp", [float(c.swiglu_limit)] * c.block_count)
        w.add_array(f"{a}.swiglu_clamp_shexp", [float(c.swiglu_limit)] * c.block_count)


def _tokenizer(w: GGUFWriter, c: SynthConfig) -> None:
    v = build_vocab(c.tokenizer_family, c.n_vocab)
    fam = v.family
    w.add_tokenizer_model(fam.model)
    w.add_tokenizer_pre(fam.pre)
    w.add_token_list(list(v.tokens))
    if fam.model == "llama":                        # _set_vocab_sentencepiece
        w.add_token_scores(list(v.scores))
    w.add_token_types(list(v.token_types))
    if fam.model != "llama":
        w.add_token_merges(list(v.merges))
    if fam.bos is not None:
        w.add_bos_token_id(v.id_of(fam.bos))
    w.add_eos_token_id(v.id_of(fam.eos))
    if fam.pad is not None:
        w.add_pad_token_id(v.id_of(fam.pad))
    if fam.eot is not None:
        w.add_eot_token_id(v.id_of(fam.eot))
    if fam.unk is not None:
        w.add_unk_token_id(v.id_of(fam.unk))
    if fam.add_bos is not None:
        w.add_add_bos_token(fam.add_bos)
    if fam.model == "llama":
        w.add_add_eos_token(False)
        w.add_add_space_prefix(True)
    w.add_chat_template(fam.template)


def metadata_items(c: SynthConfig) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """``(key, value, type, array element type)`` for every key, in file order."""
    w = GGUFWriter(None, c.arch)
    w.add_type("model")
    w.add_name(c.name)
    _generic(w, c)
    _arch(w, c)
    _tokenizer(w, c)
    w.add_quantization_version(GGML_QUANT_VERSION)
    out = []
    for key, v in w.kv_data[0].items():
        sub = None
        if v.type == GGUFValueType.ARRAY:
            sub = v.sub_type or GGUFValueType.get_type(v.value[0])
        out.append((key, v.value, v.type, sub))
    return out


def metadata_kv(c: SynthConfig) -> list[bytes]:
    """Every metadata entry as its exact file bytes."""
    return list(_encoded(c))


@lru_cache(maxsize=32)
def _encoded(c: SynthConfig) -> tuple[bytes, ...]:
    out = []
    for k, v, t, s in metadata_items(c):
        out.append(_vocab_entry(c.tokenizer_family, c.n_vocab, k) if k in _VOCAB_KEYS else encode_kv(k, v, t, s))
    return tuple(out)


_VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
               "tokenizer.ggml.scores")


@lru_cache(maxsize=16)
def _vocab_entry(family: str, n_vocab: int, key: str) -> bytes:
    # the vocabulary is most of the header; layer-count searches re-encode only the rest
    v = build_vocab(family, n_vocab)
    if key == "tokenizer.ggml.token_type":
        return encode_kv(key, list(v.token_types), GGUFValueType.ARRAY, GGUFValueType.INT32)
    if key == "tokenizer.ggml.scores":
        return encode_kv(key, list(v.scores), GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    items = v.tokens if key == "tokenizer.ggml.tokens" else v.merges
    return encode_kv(key, list(items), GGUFValueType.ARRAY, GGUFValueType.STRING)
