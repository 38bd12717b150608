"""Tiny seeded transformers glm5-next modules and their weights in GGUF layout.

The weights go through the same transforms as llama.cpp's converter (``conversion/glm.py``
``Glm5NextModel``): the fused ``conv1d`` split back into the checkpoint's ``q/k/v_conv1d`` (the
inverse of transformers' ``Concatenate(dim=0)``) and reshaped to 4-D ``[1, d_inner, 1, d_conv]``,
``A_log`` → ``ssm_a = -exp(A_log)``, ``dt_bias`` → ``ssm_dt.bias``, the ``hc_*`` tensors with a
``.weight`` suffix.
"""

from __future__ import annotations

import torch

from transformers.models.glm5_next import modeling_glm5_next as M
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

D, H, DK, DCONV = 32, 4, 8, 4


def tiny_config(n_layers: int = 2, **over) -> Glm5NextTextConfig:
    kw = dict(vocab_size=96, hidden_size=D, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=n_layers, num_attention_heads=H, num_key_value_heads=H,
              n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
              qk_nope_head_dim=8, v_head_dim=8, index_topk=16, index_head_dim=8, index_n_heads=2,
              index_kpool=4, linear_head_dim=DK, linear_num_heads=H, linear_conv_kernel_dim=DCONV,
              hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-5,
              layer_types=["linear_attention"] * n_layers, mlp_layer_types=["dense"] * n_layers,
              indexer_types=["full"] * n_layers, pad_token_id=0)
    kw.update(over)
    return Glm5NextTextConfig(**kw)


def seed_(module: torch.nn.Module, seed: int, std: float = 0.3) -> torch.nn.Module:
    """Every parameter random (the modules alone are not initialised), float32, eval."""
    g = torch.Generator().manual_seed(seed)
    module.float().eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("o_norm.weight", "layernorm.weight", "norm.weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return module


def kda_module(cfg: Glm5NextTextConfig, seed: int, layer: int = 0) -> M.Glm5NextTextLinearAttention:
    return seed_(M.Glm5NextTextLinearAttention(cfg, layer), seed)


def kda_gguf(attn: M.Glm5NextTextLinearAttention, prefix: str = "") -> dict[str, torch.Tensor]:
    """The KDA layer's tensors by GGUF name, in the converter's layout (torch order)."""
    sd = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    d_inner = attn.qkv_dim
    q, k, v = sd["conv1d.weight"].split(d_inner, dim=0)                # [d_inner, 1, d_conv]
    out = {
        "attn_q.weight": sd["q_proj.weight"], "attn_k.weight": sd["k_proj.weight"],
        "attn_v.weight": sd["v_proj.weight"], "attn_output.weight": sd["o_proj.weight"],
        "ssm_f_a.weight": sd["forget_gate.f_a_proj.weight"],
        "ssm_f_b.weight": sd["forget_gate.f_b_proj.weight"],
        "ssm_beta.weight": sd["b_proj.weight"],
        "ssm_a": -torch.exp(sd["forget_gate.A_log"].float().flatten()[:attn.num_heads]),
        "ssm_dt.bias": sd["forget_gate.dt_bias"],
        "ssm_g_a.weight": sd["g_a_proj.weight"], "ssm_g_b.weight": sd["g_b_proj.weight"],
        "ssm_norm.weight": sd["o_norm.weight"],
    }
    for name, w in (("q", q), ("k", k), ("v", v)):
        d, _, kk = w.shape
        out[f"ssm_conv1d_{name}.weight"] = w.reshape(1, d, 1, kk)
    return {prefix + k: v for k, v in out.items()}


def hc_gguf(layer: M.Glm5NextTextDecoderLayer, prefix: str = "") -> dict[str, torch.Tensor]:
    """The layer's mHC tensors by GGUF name (``hc_attn_fn.weight`` ...)."""
    out = {}
    for block, mod in (("attn", layer.attn_hc), ("ffn", layer.ffn_hc)):
        for part in ("fn", "base", "scale"):
            out[f"{prefix}hc_{block}_{part}.weight"] = getattr(mod, part).detach().clone()
    return out
