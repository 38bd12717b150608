"""transformers MoE model → GGUF with llama.cpp's exact names and metadata (and a store).

Test fixture builder for the correctness checks: a Qwen3Moe, Glm4Moe or Mixtral model is
built from a small config with seeded random weights (``tiny_model``), then written the way
llama.cpp's ``convert_hf_to_gguf.py`` writes it (``write_gguf``): keys and value types through
gguf-py's ``GGUFWriter.add_*``, tensors under llama.cpp names in ggml order, HF's fused expert
tensors split back into ``ffn_{gate,up,down}_exps``, routers and norms in F32, the Mixtral
(llama arch) q/k rows permuted for llama.cpp's adjacent-pair RoPE as ``LlamaModel.permute``
does, and a byte-level BPE vocabulary from ``expertfs.synth.tokenizer``. Experts (and, with
``matrix_type``, the other matrices) can be quantized with gguf-py; ``sync=True`` then loads the
dequantized values back into the transformers model so both sides hold identical weights.

    python tools/hf_to_gguf.py qwen3moe OUT_DIR [--experts Q8_0] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

KINDS = ("qwen3moe", "glm4moe", "mixtral", "deepseek2")
ARCH = {"qwen3moe": "qwen3moe", "glm4moe": "glm4moe", "mixtral": "llama", "deepseek2": "deepseek2"}
_FLOAT = {T.F32: np.float32, T.F16: np.float16}


def tiny_config(kind: str, **over):
    """A small config of ``kind`` that exercises its features (groups, biases, partial rope)."""
    import transformers as tf
    common = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=3, max_position_embeddings=4096,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "qwen3moe":
        cfg = dict(common, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                   norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                   decoder_sparse_step=1, mlp_only_layers=[])
        cls = tf.Qwen3MoeConfig
    elif kind == "glm4moe":
        cfg = dict(common, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                   n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True,
                   attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True,
                   n_group=2, topk_group=1, rms_norm_eps=1e-5, partial_rotary_factor=0.5,
                   rope_theta=1_000_000.0, num_nextn_predict_layers=0)
        cls = tf.Glm4MoeConfig
    elif kind == "mixtral":
        cfg = dict(common, intermediate_size=32, num_local_experts=4, rms_norm_eps=1e-5,
                   rope_theta=1_000_000.0)
        cls = tf.MixtralConfig
    elif kind == "deepseek2":                       # DeepSeek-V3 layout, MLA, written as deepseek2
        cfg = dict(common, num_key_value_heads=4, intermediate_size=128,
                   moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                   first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2,
                   topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   rms_norm_eps=1e-6, rope_theta=10000.0)
        cfg.pop("head_dim")
        cls = tf.DeepseekV3Config
    else:
        raise ValueError(f"unknown kind {kind!r}; use one of {KINDS}")
    scaling = over.pop("rope_scaling", None)
    cfg.update(over)
    rope = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default", **(scaling or {})}
    if "partial_rotary_factor" in cfg:
        rope["partial_rotary_factor"] = cfg.pop("partial_rotary_factor")
    return cls(rope_parameters=rope, **cfg)


def tiny_model(kind: str, seed: int = 0, **over):
    """A float32 transformers model of ``kind`` with seeded weights of unit-scale activations."""
    import transformers as tf
    cfg = tiny_config(kind, **over)
    cls = {"qwen3moe": tf.Qwen3MoeForCausalLM, "glm4moe": tf.Glm4MoeForCausalLM,
           "mixtral": tf.MixtralForCausalLM, "deepseek2": tf.DeepseekV3ForCausalLM}[kind]
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        named = list(model.named_parameters()) + list(model.named_buffers())
        for name, p in named:
            if not p.dtype.is_floating_point or "inv_freq" in name:
                continue
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            elif p.dim() >= 2:
                p.copy_(r / math.sqrt(p.shape[-1]))
    return model


@dataclass(frozen=True)
class Written:
    path: str
    arch: str
    n_tensors: int


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf ``LlamaModel.permute``: HF rotate-half rows → adjacent pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class _Out:
    def __init__(self, w: GGUFWriter, expert_type: T, matrix_type: T) -> None:
        self.w, self.et, self.mt = w, expert_type, matrix_type
        self.dequant: dict[str, np.ndarray] = {}   # name → the values llama.cpp will see
        self.n = 0

    def add(self, name: str, a: np.ndarray, qt: T = T.F32) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim == 1 or qt == T.F32:
            self.w.add_tensor(name, a)
            self.dequant[name] = a
        elif qt in _FLOAT:
            v = a.astype(_FLOAT[qt])
            self.w.add_tensor(name, v)
            self.dequant[name] = v.astype(np.float32)
        else:
            q = quants.quantize(a, qt)
            self.w.add_tensor(name, q, raw_dtype=qt)
            self.dequant[name] = quants.dequantize(q, qt).reshape(a.shape)
        self.n += 1

    def mat(self, name: str, a: np.ndarray) -> None:
        self.add(name, a, self.mt)

    def exp(self, name: str, a: np.ndarray) -> None:
        self.add(name, a, self.et)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _metadata(w: GGUFWriter, kind: str, c, n_vocab: int) -> None:
    rp = c.rope_parameters
    w.add_type("model")
    w.add_name(f"tiny {kind} from transformers")
    n_nextn = int(getattr(c, "num_nextn_predict_layers", 0) or 0) if kind == "glm4moe" else 0
    w.add_block_count(c.num_hidden_layers + n_nextn)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1 if kind == "deepseek2" else c.num_key_value_heads)  # MLA: MQA
    rp = c.rope_parameters
    if rp.get("rope_type", "default") in ("yarn", "linear"):      # TextModel.set_gguf_parameters
        from gguf import RopeScalingType
        w.add_rope_scaling_type(RopeScalingType.YARN if rp["rope_type"] == "yarn"
                                else RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))
        if rp["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
            if rp.get("beta_fast") is not None:                    # as conversion/base.py
                w.add_rope_scaling_yarn_beta_fast(float(rp["beta_fast"]))
            if rp.get("beta_slow") is not None:
                w.add_rope_scaling_yarn_beta_slow(float(rp["beta_slow"]))
    w.add_rope_freq_base(float(rp["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    n_exp = {"qwen3moe": "num_experts", "glm4moe": "n_routed_experts",
             "mixtral": "num_local_experts", "deepseek2": "n_routed_experts"}[kind]
    w.add_expert_count(getattr(c, n_exp))
    w.add_expert_used_count(c.num_experts_per_tok)
    if kind in ("qwen3moe", "glm4moe"):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if kind in ("glm4moe", "deepseek2") and c.n_group > 1:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    w.add_file_type(0)
    if kind == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    elif kind == "mixtral":
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    elif kind == "glm4moe":
        w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters.get(
            "partial_rotary_factor", 0.5)))
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        from gguf import ExpertGatingFuncType
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(float(c.routed_scaling_factor))
        w.add_expert_weights_norm(bool(c.norm_topk_prob))
        if n_nextn:
            w.add_nextn_predict_layers(n_nextn)
    elif kind == "deepseek2":                      # DeepseekV2Model.set_gguf_parameters
        from gguf import ExpertGatingFuncType
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_vocab_size(n_vocab)
        if c.q_lora_rank:
            w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_scale(float(c.routed_scaling_factor))
        w.add_expert_weights_norm(bool(c.norm_topk_prob))
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        if rp.get("rope_type") == "yarn" and rp.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(0.1 * float(rp["mscale_all_dim"]))


def _tokenizer(w: GGUFWriter, kind: str, n_vocab: int) -> None:
    from expertfs.synth.tokenizer import build_vocab
    v = build_vocab(ARCH[kind], n_vocab)
    fam = v.family
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fam.pre)
    w.add_token_list(list(v.tokens))
    w.add_token_types(list(v.token_types))
    w.add_token_merges(list(v.merges))
    if fam.bos is not None:
        w.add_bos_token_id(v.id_of(fam.bos))
    w.add_eos_token_id(v.id_of(fam.eos))
    if fam.add_bos is not None:
        w.add_add_bos_token(fam.add_bos)
    w.add_chat_template(fam.template)


def write_gguf(model, kind: str, path: str, *, expert_type: T = T.F32,
               matrix_type: T = T.F32, sync: bool = False, nextn_seed: int | None = None) -> Written:
    """Write ``model`` as llama.cpp would load it. ``sync``: load the written (dequantized)
    values back into ``model``. ``nextn_seed`` (glm4moe): append a random NextN block."""
    c = model.config
    sd = {k: v for k, v in model.state_dict().items()}
    arch = ARCH[kind]
    n_vocab = c.vocab_size
    if nextn_seed is not None:
        if kind != "glm4moe":
            raise ValueError("only glm4moe carries a NextN block")
        c.num_nextn_predict_layers = 1
    w = GGUFWriter(path, arch)
    _metadata(w, kind, c, n_vocab)
    _tokenizer(w, kind, n_vocab)
    o = _Out(w, expert_type, matrix_type)
    back: dict[str, tuple[str, ...]] = {}     # HF name → GGUF names that rebuild it
    o.mat("token_embd.weight", _np(sd["model.embed_tokens.weight"]))
    back["model.embed_tokens.weight"] = ("token_embd.weight",)
    H, K = c.num_attention_heads, c.num_key_value_heads
    for i in range(c.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        _block(o, sd, hf, p, kind, c, H, K, back)
    if nextn_seed is not None:
        _random_nextn(o, c, c.num_hidden_layers, nextn_seed)
    o.add("output_norm.weight", _np(sd["model.norm.weight"]))
    o.mat("output.weight", _np(sd["lm_head.weight"]))
    back["model.norm.weight"] = ("output_norm.weight",)
    back["lm_head.weight"] = ("output.weight",)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if sync:
        _sync(model, o.dequant, back, kind, H, K)
    return Written(path, arch, o.n)


def _mla(o: _Out, sd, a: str, p: str, c, back) -> None:
    """DeepseekV2Model.modify_tensors: kv_b_proj split into k_b (transposed) and v_b."""
    for x, hx in (("q_a", "q_a_proj"), ("q_b", "q_b_proj"), ("q", "q_proj"),
                  ("kv_a_mqa", "kv_a_proj_with_mqa"), ("output", "o_proj")):
        if f"{a}{hx}.weight" in sd:
            o.mat(f"{p}attn_{x}.weight", _np(sd[f"{a}{hx}.weight"]))
            back[f"{a}{hx}.weight"] = (f"{p}attn_{x}.weight",)
    for x, hx in (("q_a_norm", "q_a_layernorm"), ("kv_a_norm", "kv_a_layernorm")):
        if f"{a}{hx}.weight" in sd:
            o.add(f"{p}attn_{x}.weight", _np(sd[f"{a}{hx}.weight"]))
            back[f"{a}{hx}.weight"] = (f"{p}attn_{x}.weight",)
    H, N, V = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    kv_b = _np(sd[a + "kv_b_proj.weight"]).reshape(H, N + V, c.kv_lora_rank)
    o.add(p + "attn_k_b.weight", kv_b[:, :N].transpose(0, 2, 1))        # [H, L, N]
    o.add(p + "attn_v_b.weight", kv_b[:, N:])                           # [H, V, L]
    back[a + "kv_b_proj.weight"] = (p + "attn_k_b.weight", p + "attn_v_b.weight")


def _block(o: _Out, sd, hf: str, p: str, kind: str, c, H: int, K: int, back) -> None:
    a = hf + "self_attn."
    o.add(p + "attn_norm.weight", _np(sd[hf + "input_layernorm.weight"]))
    back[hf + "input_layernorm.weight"] = (p + "attn_norm.weight",)
    post = "post_attention_norm" if kind == "glm4moe" else "ffn_norm"
    o.add(p + post + ".weight", _np(sd[hf + "post_attention_layernorm.weight"]))
    back[hf + "post_attention_layernorm.weight"] = (p + post + ".weight",)
    if kind == "deepseek2":
        _mla(o, sd, a, p, c, back)
    for x, hx in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
        if kind == "deepseek2":
            break
        wt = _np(sd[f"{a}{hx}.weight"])
        if kind == "mixtral" and x in ("q", "k"):
            wt = _permute(wt, H if x == "q" else K)
        o.mat(f"{p}attn_{x}.weight", wt)
        back[f"{a}{hx}.weight"] = (f"{p}attn_{x}.weight",)
        if f"{a}{hx}.bias" in sd:
            o.add(f"{p}attn_{x}.bias", _np(sd[f"{a}{hx}.bias"]))
            back[f"{a}{hx}.bias"] = (f"{p}attn_{x}.bias",)
    for x in ("q", "k"):
        if f"{a}{x}_norm.weight" in sd:
            o.add(f"{p}attn_{x}_norm.weight", _np(sd[f"{a}{x}_norm.weight"]))
            back[f"{a}{x}_norm.weight"] = (f"{p}attn_{x}_norm.weight",)
    m = hf + "mlp."
    if m + "gate.weight" not in sd:                        # dense (glm4moe leading layers)
        for x in ("gate", "up", "down"):
            o.mat(f"{p}ffn_{x}.weight", _np(sd[f"{m}{x}_proj.weight"]))
            back[f"{m}{x}_proj.weight"] = (f"{p}ffn_{x}.weight",)
        return
    o.add(p + "ffn_gate_inp.weight", _np(sd[m + "gate.weight"]))
    back[m + "gate.weight"] = (p + "ffn_gate_inp.weight",)
    if m + "gate.e_score_correction_bias" in sd:
        o.add(p + "exp_probs_b.bias", _np(sd[m + "gate.e_score_correction_bias"]))
        back[m + "gate.e_score_correction_bias"] = (p + "exp_probs_b.bias",)
    gu = _np(sd[m + "experts.gate_up_proj"])               # [E, 2I, H]: gate rows, then up
    n_ff = gu.shape[1] // 2
    o.exp(p + "ffn_gate_exps.weight", gu[:, :n_ff])
    o.exp(p + "ffn_up_exps.weight", gu[:, n_ff:])
    o.exp(p + "ffn_down_exps.weight", _np(sd[m + "experts.down_proj"]))
    back[m + "experts.gate_up_proj"] = (p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight")
    back[m + "experts.down_proj"] = (p + "ffn_down_exps.weight",)
    if m + "shared_experts.gate_proj.weight" in sd:
        for x in ("gate", "up", "down"):
            o.mat(f"{p}ffn_{x}_shexp.weight", _np(sd[f"{m}shared_experts.{x}_proj.weight"]))
            back[f"{m}shared_experts.{x}_proj.weight"] = (f"{p}ffn_{x}_shexp.weight",)


def _random_nextn(o: _Out, c, layer: int, seed: int) -> None:
    """A glm4moe NextN block of random weights (transformers builds none)."""
    rng = np.random.default_rng(seed)
    D, E, I, hd = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size, c.head_dim
    H, K = c.num_attention_heads, c.num_key_value_heads
    r = lambda *s: (rng.standard_normal(s) / math.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    n = lambda d: (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)  # noqa: E731
    p = f"blk.{layer}."
    o.add(p + "nextn.eh_proj.weight", r(D, 2 * D))
    o.add(p + "nextn.enorm.weight", n(D))
    o.add(p + "nextn.hnorm.weight", n(D))
    o.add(p + "attn_norm.weight", n(D))
    o.add(p + "post_attention_norm.weight", n(D))
    for x, rows in (("q", H * hd), ("k", K * hd), ("v", K * hd)):
        o.mat(f"{p}attn_{x}.weight", r(rows, D))
        o.add(f"{p}attn_{x}.bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
    o.mat(p + "attn_output.weight", r(D, H * hd))
    o.add(p + "attn_q_norm.weight", n(hd))
    o.add(p + "attn_k_norm.weight", n(hd))
    o.add(p + "ffn_gate_inp.weight", r(E, D))
    o.add(p + "exp_probs_b.bias", (0.1 * rng.standard_normal(E)).astype(np.float32))
    o.exp(p + "ffn_gate_exps.weight", r(E, I, D))
    o.exp(p + "ffn_up_exps.weight", r(E, I, D))
    o.exp(p + "ffn_down_exps.weight", r(E, D, I))
    for x, shape in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
        o.mat(f"{p}ffn_{x}_shexp.weight", r(*shape))
    o.add(p + "nextn.shared_head_norm.weight", n(D))


def _sync(model, deq: dict[str, np.ndarray], back, kind: str, H: int, K: int) -> None:
    """Load the values llama.cpp will see back into ``model`` (undoing the q/k permute)."""
    with torch.no_grad():
        params = dict(model.named_parameters()) | dict(model.named_buffers())
        for hf_name, names in back.items():
            vals = [deq[n] for n in names]
            if hf_name.endswith("kv_b_proj.weight"):            # k_b [H, L, N], v_b [H, V, L]
                v = np.concatenate((vals[0].transpose(0, 2, 1), vals[1]), axis=1)
                v = v.reshape(-1, v.shape[-1])
            elif len(vals) == 2:
                v = np.concatenate(vals, axis=1)
            else:
                v = vals[0]
            if kind == "mixtral" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                n_head = H if "q_proj" in hf_name else K
                v = _unpermute(v, n_head)
            params[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(v)))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def convert(kind: str, out_dir: str, *, seed: int = 0, expert_type: T = T.F32,
            matrix_type: T = T.F32, sync: bool = False, nextn: bool = False,
            store: bool = True, **over):
    """Build ``tiny_model(kind)``, write ``OUT/{kind}.gguf`` and (``store``) ``OUT/{kind}.efs``.

    Returns ``(model, gguf_path, store_path_or_None)``.
    """
    model = tiny_model(kind, seed, **over)
    os.makedirs(out_dir, exist_ok=True)
    tag = f"{kind}-{expert_type.name}-{matrix_type.name}"
    gguf_path = os.path.join(out_dir, tag + ".gguf")
    write_gguf(model, kind, gguf_path, expert_type=expert_type, matrix_type=matrix_type,
               sync=sync, nextn_seed=seed + 1 if nextn else None)
    store_path = None
    if store:
        from expertfs.store.repack import repack
        store_path = os.path.join(out_dir, tag + ".efs")
        repack([gguf_path], store_path, force=True)
    return model, gguf_path, store_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", default="F32", help="ggml type of the routed experts")
    ap.add_argument("--matrices", default="F32", help="ggml type of the other matrices")
    ap.add_argument("--nextn", action="store_true", help="glm4moe: add a random NextN block")
    args = ap.parse_args(argv)
    _, g, s = convert(args.kind, args.out_dir, seed=args.seed, expert_type=T[args.experts.upper()],
                      matrix_type=T[args.matrices.upper()], nextn=args.nextn)
    sys.stdout.write(f"{g}\n{s}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
