"""Geometries of real MoE models (``--like``) and the tiny defaults of each architecture.

Each preset copies the model's HF ``config.json`` as ``convert_hf_to_gguf`` turns it into GGUF
metadata. Sources are named per entry; where two agree, both are given.
"""

from __future__ import annotations

from ..errors import UsageError

__all__ = ["PRESETS", "like_fields", "tiny_fields", "preset_names"]

_QWEN3 = dict(arch="qwen3moe", head_dim=128, n_head_kv=4, n_vocab=151936, n_ctx_train=40960,
              rope_freq_base=1_000_000.0, rms_eps=1e-6, qk_norm=True, n_experts=128,
              n_expert_used=8)
_GLM45 = dict(arch="glm4moe", head_dim=128, rope_dim=64, n_head=96, n_head_kv=8, n_vocab=151552,
              n_ctx_train=131072, rope_freq_base=1_000_000.0, rms_eps=1e-5, qkv_bias=True,
              n_expert_used=8, n_expert_shared=1, n_nextn=1, gating=2, expert_weights_norm=True,
              expert_group_count=1, expert_group_used_count=1, probs_bias=True)
_GPT_OSS = dict(arch="gpt-oss", n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_ff=2880,
                n_ff_exp=2880, n_expert_used=4, n_vocab=201088, n_ctx_train=131072,
                rope_freq_base=150000.0, rms_eps=1e-5, qk_norm=False, qkv_bias=True,
                sliding_window=128, rope_scaling="yarn", rope_scaling_factor=32.0,
                rope_orig_ctx=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0, quant="mxfp4_moe")

# GLM-5 family, both from zai-org config.json as transformers 5.24 defaults them: 154880 tokens,
# 1 shared expert, sigmoid routing with exp_probs_b (1 group), top-8, scaling 2.5, 3 dense
# blocks, one NextN block, MLA kv_lora 512 / v 256, indexer 32 heads x 128 top-2048
_GLM5 = dict(n_head=64, n_head_kv=1, n_ff=12288, n_ff_exp=2048, n_expert_used=8, n_expert_shared=1,
             n_dense_lead=3, n_nextn=1, n_vocab=154880, n_ctx_train=1048576, rms_eps=1e-5,
             qk_norm=False, kv_lora_rank=512, v_head_dim=256, expert_weights_scale=2.5,
             expert_weights_norm=True, expert_group_count=1, expert_group_used_count=1,
             probs_bias=True, indexer_heads=32, indexer_head_dim=128, indexer_top_k=2048)

PRESETS: dict[str, dict[str, object]] = {
    # Qwen/Qwen3-30B-A3B config.json; slime scripts/models/qwen3-30B-A3B.sh
    "Qwen3-30B-A3B": dict(_QWEN3, name="Qwen3-30B-A3B", n_layers=48, n_embd=2048, n_head=32,
                          n_ff=6144, n_ff_exp=768),
    # Qwen/Qwen3-235B-A22B config.json; slime scripts/models/qwen3-235B-A22B.sh
    "Qwen3-235B-A22B": dict(_QWEN3, name="Qwen3-235B-A22B", n_layers=94, n_embd=4096, n_head=64,
                            n_ff=12288, n_ff_exp=1536),
    # zai-org/GLM-4.5-Air config.json; slime scripts/models/glm4.5-106B-A12B.sh (1 dense + 45
    # MoE layers, moe_ffn 1408, routed_scaling_factor 1.0, no qk-norm) + 1 NextN layer
    "GLM-4.5-Air": dict(_GLM45, name="GLM-4.5-Air", n_layers=46, n_embd=4096, n_ff=10944,
                        n_ff_exp=1408, n_experts=128, n_dense_lead=1, qk_norm=False,
                        expert_weights_scale=1.0),
    # zai-org/GLM-4.5 config.json; slime scripts/models/glm4.5-355B-A32B.sh (3 dense + 89 MoE,
    # 160 experts, moe_ffn 1536, qk-layernorm, topk scaling 2.5) + 1 NextN layer
    "GLM-4.5": dict(_GLM45, name="GLM-4.5", n_layers=92, n_embd=5120, n_ff=12288, n_ff_exp=1536,
                    n_experts=160, n_dense_lead=3, qk_norm=True, expert_weights_scale=2.5),
    # openai/gpt-oss-20b config.json (hidden 2880, 24 layers, 32 experts top-4, head_dim 64,
    # sliding_window 128, yarn factor 32 over 4096, rope_theta 150000, vocab 201088)
    "gpt-oss-20b": dict(_GPT_OSS, name="gpt-oss-20b", n_layers=24, n_experts=32),
    # openai/gpt-oss-120b config.json: as 20b with 36 layers and 128 experts
    "gpt-oss-120b": dict(_GPT_OSS, name="gpt-oss-120b", n_layers=36, n_experts=128),
    # mistralai/Mixtral-8x7B-v0.1 config.json (llama arch in GGUF; experts sized by n_ff)
    "Mixtral-8x7B": dict(arch="llama", name="Mixtral-8x7B", n_layers=32, n_embd=4096, n_head=32,
                         n_head_kv=8, head_dim=128, n_ff=14336, n_ff_exp=14336, n_experts=8,
                         n_expert_used=2, n_vocab=32000, n_ctx_train=32768,
                         rope_freq_base=1_000_000.0, rms_eps=1e-5, qk_norm=False,
                         tokenizer="mixtral"),
    # deepseek-ai/DeepSeek-V3 config.json (61 layers, 3 dense, 256 experts top-8 in 8 groups
    # keep 4, MLA q_lora 1536 kv_lora 512 nope 128 rope 64 v 128, yarn 40 over 4096,
    # mscale_all_dim 1 → yarn_log_multiplier 0.1). The converter drops its MTP layer
    # (DeepseekV2Model.skip_mtp) and writes head_count_kv = 1.
    "DeepSeek-V3": dict(arch="deepseek2", name="DeepSeek-V3", n_layers=61, n_embd=7168, n_head=128,
                        n_head_kv=1, head_dim=192, n_ff=18432, n_ff_exp=2048, n_experts=256,
                        n_expert_used=8, n_expert_shared=1, n_dense_lead=3, n_vocab=129280,
                        n_ctx_train=163840, rope_freq_base=10000.0, rope_dim=64, rms_eps=1e-6,
                        qk_norm=False, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128,
                        qk_rope_dim=64, v_head_dim=128, gating=2, expert_weights_scale=2.5,
                        expert_weights_norm=True, expert_group_count=8, expert_group_used_count=4,
                        probs_bias=True, rope_scaling="yarn", rope_scaling_factor=40.0,
                        rope_orig_ctx=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
                        yarn_log_mul=0.1),
    # moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3's MLA and widths with 64 heads, 1 dense
    # layer, 384 experts top-8 in 1 group, routed_scaling_factor 2.827, rope_theta 50000, yarn 32
    # over 4096 (beta_fast 1, beta_slow 1, mscale_all_dim 1), vocab 163840, tokenizer kimi-k2
    "Kimi-K2": dict(arch="deepseek2", name="Kimi-K2", n_layers=61, n_embd=7168, n_head=64,
                    n_head_kv=1, head_dim=192, n_ff=18432, n_ff_exp=2048, n_experts=384,
                    n_expert_used=8, n_expert_shared=1, n_dense_lead=1, n_vocab=163840,
                    n_ctx_train=131072, rope_freq_base=50000.0, rope_dim=64, rms_eps=1e-6,
                    qk_norm=False, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128,
                    qk_rope_dim=64, v_head_dim=128, gating=2, expert_weights_scale=2.827,
                    expert_weights_norm=True, expert_group_count=1, expert_group_used_count=1,
                    probs_bias=True, rope_scaling="yarn", rope_scaling_factor=32.0,
                    rope_orig_ctx=4096, yarn_beta_fast=1.0, yarn_beta_slow=1.0,
                    yarn_log_mul=0.1, tokenizer="kimi-k2"),
    # deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers, 1 dense (10944), 64 experts of 1408
    # top-6 + 2 shared, softmax routing without top-k norm, 16 heads, no q_lora, kv_lora 512,
    # nope 128 rope 64 v 128, yarn 40 over 4096 (mscale_all_dim 0.707), vocab 102400
    "DeepSeek-V2-Lite": dict(arch="deepseek2", name="DeepSeek-V2-Lite", n_layers=27, n_embd=2048,
                             n_head=16, n_head_kv=1, head_dim=192, n_ff=10944, n_ff_exp=1408,
                             n_experts=64, n_expert_used=6, n_expert_shared=2, n_dense_lead=1,
                             n_vocab=102400, n_ctx_train=163840, rope_freq_base=10000.0,
                             rope_dim=64, rms_eps=1e-6, qk_norm=False, kv_lora_rank=512,
                             qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, gating=1,
                             expert_weights_scale=1.0, expert_weights_norm=False,
                             rope_scaling="yarn", rope_scaling_factor=40.0, rope_orig_ctx=4096,
                             yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_log_mul=0.0707,
                             tokenizer="deepseek-llm"),
    # zai-org/GLM-5.3-Flash (transformers Glm5NextTextConfig defaults): 45 layers, hidden 4096,
    # 288 experts of 2048, KDA on 3 of 4 layers (64 heads x 128, conv 4, gate lower bound -5),
    # nope-only MLA q_lora 1536 nope 256, indexer k-pool 16 (full on every MLA layer), mHC 4
    # streams (20 Sinkhorn iterations, eps 1e-6), SwiGLU clamp 10
    "GLM-5.3-Flash": dict(_GLM5, arch="glm5-next", name="GLM-5.3-Flash", n_layers=45, n_embd=4096,
                          head_dim=256, n_experts=288, q_lora_rank=1536, qk_nope_dim=256,
                          qk_rope_dim=0, indexer_kpool=16, indexer_freq=1, kda_interval=4,
                          kda_head_dim=128, ssm_conv_kernel=4, kda_gate_lower_bound=-5.0,
                          hc_mult=4, swiglu_limit=10.0),
    # zai-org/GLM-5.2 (GlmMoeDsaConfig defaults, the GLM-5 geometry: 78 layers, hidden 6144, 256
    # experts, MLA q_lora 2048 nope 192 rope 64, rope_theta 10000) with 5.2's 1M context and its
    # indexer schedule (full on layers 0-2 and every 4th after: llama.cpp's
    # GLM_5_2_DEFAULT_INDEXER_TYPES)
    "GLM-5.2": dict(_GLM5, arch="glm-dsa", name="GLM-5.2", n_layers=78, n_embd=6144, head_dim=256,
                    n_experts=256, q_lora_rank=2048, qk_nope_dim=192, qk_rope_dim=64,
                    rope_dim=64, rope_freq_base=10000.0, indexer_freq=4, indexer_offset=3),
}

_TINY: dict[str, dict[str, object]] = {
    "qwen3moe": dict(arch="qwen3moe", name="tiny qwen3moe"),
    "glm4moe": dict(arch="glm4moe", name="tiny glm4moe", rope_dim=32, n_expert_shared=1,
                    n_dense_lead=1, n_nextn=1, qkv_bias=True, qk_norm=True, rms_eps=1e-5,
                    gating=2, expert_weights_scale=2.5, expert_weights_norm=True,
                    expert_group_count=1, expert_group_used_count=1, probs_bias=True),
    "llama": dict(arch="llama", name="tiny mixtral", n_ff=256, n_experts=4, qk_norm=False,
                  rms_eps=1e-5),
    "deepseek2": dict(arch="deepseek2", name="tiny deepseek2", n_head_kv=1, head_dim=96,
                      n_expert_shared=1, n_dense_lead=1, rope_dim=32, qk_norm=False,
                      q_lora_rank=256, kv_lora_rank=256, qk_nope_dim=64, qk_rope_dim=32,
                      v_head_dim=64, gating=2, expert_weights_scale=2.5, expert_weights_norm=True,
                      expert_group_count=4, expert_group_used_count=2, probs_bias=True),
    "gpt-oss": dict(arch="gpt-oss", name="tiny gpt-oss", n_ff=256, n_experts=4, qk_norm=False,
                    qkv_bias=True, rms_eps=1e-5, rope_freq_base=150000.0, sliding_window=128,
                    rope_scaling="yarn", rope_scaling_factor=32.0, rope_orig_ctx=4096,
                    yarn_beta_fast=32.0, yarn_beta_slow=1.0, quant="mxfp4_moe"),
    # KDA, MLA, KDA, MLA (full then shared indexer), 1 dense block, a NextN block
    "glm5-next": dict(_GLM5, arch="glm5-next", name="tiny glm5-next", n_layers=4, n_embd=256,
                      n_head=4, head_dim=64, n_ff=512, n_ff_exp=256, n_experts=8,
                      n_expert_used=2, n_dense_lead=1, n_vocab=1024, n_ctx_train=4096,
                      q_lora_rank=256, kv_lora_rank=256, qk_nope_dim=64, qk_rope_dim=0,
                      v_head_dim=64, indexer_heads=2, indexer_head_dim=64, indexer_top_k=32,
                      indexer_kpool=4, indexer_freq=4, indexer_offset=2, kda_interval=2,
                      kda_head_dim=64, ssm_conv_kernel=4, kda_gate_lower_bound=-5.0, hc_mult=4,
                      swiglu_limit=10.0),
    # full, full, shared, full indexers; 1 dense block, a NextN block
    "glm-dsa": dict(_GLM5, arch="glm-dsa", name="tiny glm-dsa", n_layers=4, n_embd=256, n_head=4,
                    head_dim=96, n_ff=512, n_ff_exp=256, n_experts=8, n_expert_used=2,
                    n_dense_lead=1, n_vocab=1024, n_ctx_train=4096, q_lora_rank=256,
                    kv_lora_rank=256, qk_nope_dim=64, qk_rope_dim=32, rope_dim=32, v_head_dim=64,
                    indexer_heads=2, indexer_head_dim=64, indexer_top_k=32, indexer_freq=2,
                    indexer_offset=2),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def like_fields(name: str) -> dict[str, object]:
    """The preset named ``name`` (case-insensitive), as ``SynthConfig`` keyword arguments."""
    for key, fields in PRESETS.items():
        if key.lower() == name.strip().lower():
            return dict(fields)
    raise UsageError(f"--like {name!r} is not a known model",
                     fix=f"use one of {', '.join(PRESETS)}")


def tiny_fields(arch: str) -> dict[str, object]:
    try:
        return dict(_TINY[arch])
    except KeyError:
        raise UsageError(f"unknown architecture {arch!r}", fix=f"use one of {', '.join(_TINY)}") from None
