"""The blocks of the GLM-5 family: ``glm-dsa`` (GLM-5.2: MLA + the DSA indexer) and ``glm5-next``
(GLM-5.3-Flash: KDA and nope-only MLA layers, the indexer with k-pool compression, mHC streams).

Names, ggml shapes and order are those ``convert_hf_to_gguf`` (``conversion/glm.py``
``GlmMoeDsaModel``/``Glm5NextModel``) writes and ``src/models/{glm-dsa,glm5-next}.cpp`` loads:
inside a block the sorted HF names — ``hc_*`` (trunk layers of glm5-next only), then
``input_layernorm``, ``mlp.*``, ``post_attention_layernorm``, ``self_attn.*`` (the indexer's
tensors first, only on full-indexer layers and the NextN block). The KDA layer's ``A_log`` is
written as ``ssm_a`` (no suffix, −exp(A_log)), ``dt_bias`` as ``ssm_dt.bias``, its convolutions as
4-D ``(d_conv, 1, d_inner, 1)``. F32 are the norms, the router, ``exp_probs_b``, the mixing and
gating parameters (``hc_*``, ``ssm_a``, ``ssm_dt``, ``ssm_conv1d_*``) and the indexer's ``proj``
and k-pool compressor, as the converter keeps them.
"""

from __future__ import annotations

from .archs import (Init, TensorPlan, _bias, _dense, _mla, _nextn_head, _nextn_tail, _norm,
                    _router, _routed, _shexp, _w)
from .config import SynthConfig
from .quant import Role, use_more_bits

__all__ = ["dsa_block"]


def _f32(name: str, ne: tuple[int, ...], init: Init = Init.W) -> TensorPlan:
    return TensorPlan(name, ne, Role.F32, init)


def _hc(c: SynthConfig, p: str) -> list[TensorPlan]:
    """mHC pre/post/comb mixing of the attention and FFN sublayers."""
    mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.n_embd
    out = []
    for part in ("attn", "ffn"):
        out += [_f32(f"{p}.hc_{part}_base.weight", (mix,), Init.BIAS),
                _f32(f"{p}.hc_{part}_fn.weight", (width, mix)),
                _f32(f"{p}.hc_{part}_scale.weight", (3,), Init.BIAS)]
    return out


def _ffn(c: SynthConfig, p: str, i: int) -> list[TensorPlan]:
    if not c.is_moe_block(i):
        return _dense(c, p)
    routed = _routed(c, p)
    if use_more_bits(i, c.n_layers):
        routed = [TensorPlan(t.name, t.ne, Role.DOWN_MORE, t.init) if t.role is Role.DOWN else t
                  for t in routed]
    return [*routed, _bias(f"{p}.exp_probs_b", (c.n_experts,)),
            _router(f"{p}.ffn_gate_inp", (c.n_embd, c.n_experts)), *_shexp(c, p)]


def _indexer(c: SynthConfig, p: str, i: int) -> list[TensorPlan]:
    if not c.indexer_full(i):
        return []
    e, d, h = c.n_embd, c.indexer_head_dim, c.indexer_heads
    out = []
    if c.arch == "glm5-next":
        out += [_f32(f"{p}.indexer_compressor_ape.weight", (d, c.indexer_kpool), Init.BIAS),
                _f32(f"{p}.indexer_compressor_gate.weight", (e, d))]
    return out + [_bias(f"{p}.indexer.k_norm", (d,)), _norm(f"{p}.indexer.k_norm", d),
                  _router(f"{p}.indexer.proj", (e, h)),
                  _w(f"{p}.indexer.attn_k", (e, d), Role.INDEXER),
                  _w(f"{p}.indexer.attn_q_b", (c.q_lora_rank, h * d), Role.INDEXER)]


def _kda(c: SynthConfig, p: str) -> list[TensorPlan]:
    """self_attn.{A_log, b_proj, dt_bias, f_a/f_b, g_a/g_b, k_conv1d, k_proj, o_norm, o_proj,
    q_conv1d, q_proj, v_conv1d, v_proj} in that (sorted) order."""
    e, d, h = c.n_embd, c.kda_head_dim, c.n_head
    inner, conv = d * h, (c.ssm_conv_kernel, 1, d * h, 1)
    k = Role.KDA
    return [_f32(f"{p}.ssm_a", (h,), Init.DECAY), _w(f"{p}.ssm_beta", (e, h), k),
            _bias(f"{p}.ssm_dt", (inner,)),
            _w(f"{p}.ssm_f_a", (e, d), k), _w(f"{p}.ssm_f_b", (d, inner), k),
            _w(f"{p}.ssm_g_a", (e, d), k), _w(f"{p}.ssm_g_b", (d, inner), k),
            _f32(f"{p}.ssm_conv1d_k.weight", conv), _w(f"{p}.attn_k", (e, inner), k),
            _norm(f"{p}.ssm_norm", d), _w(f"{p}.attn_output", (inner, e), k),
            _f32(f"{p}.ssm_conv1d_q.weight", conv), _w(f"{p}.attn_q", (e, inner), k),
            _f32(f"{p}.ssm_conv1d_v.weight", conv), _w(f"{p}.attn_v", (e, inner), k)]


def dsa_block(c: SynthConfig, i: int) -> list[TensorPlan]:
    """Every tensor of block ``i`` (a NextN block when ``i >= n_layers``), in file order."""
    p, e = f"blk.{i}", c.n_embd
    nextn = i >= c.n_layers
    out = _nextn_head(c, p) if nextn else []
    if c.arch == "glm5-next" and not nextn:
        out += _hc(c, p)
    out += [_norm(f"{p}.attn_norm", e), *_ffn(c, p, i), _norm(f"{p}.ffn_norm", e)]
    if c.is_kda_block(i):
        out += _kda(c, p)
    else:
        out += [*_indexer(c, p, i), *_mla(c, p)]
    return out + (_nextn_tail(c, p) if nextn else [])
