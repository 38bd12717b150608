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
                         rope_freq_base=1_000_000.0, rms_eps=1e-5, qk_norm=False),
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
