"""The tensors of each architecture: names, ggml shapes and order, as llama.cpp loads them.

Names and shapes are those ``create_tensor`` asks for in llama.cpp's ``src/models/<arch>.cpp``;
an extra or missing tensor fails llama.cpp's load ("wrong number of tensors"). The order is the
one ``convert_hf_to_gguf`` emits for a checkpoint in one file: ``token_embd``, then each block in
turn, then ``output_norm`` and ``output``. Inside a block, tensors follow the sorted HF names
(``input_layernorm``, ``mlp.*`` with routed experts merged as down, gate, up, ``post_attention_
layernorm``, ``self_attn.*``), and a NextN block's ``eh_proj``/``enorm``/``hnorm`` come first and
its ``shared_head`` last, as the sort puts them.

``Init`` says how a tensor is filled: ``W`` weights of std 1/sqrt(fan_in) (fan_in = ne[0], the
length ggml contracts over), ``NORM`` ones with a little noise, ``BIAS`` small noise, ``DECAY``
a KDA ``ssm_a`` (−exp(A_log) with A_log uniform in [0, ln 16], the usual initialisation).

The GLM-5 family (``glm-dsa``, ``glm5-next``) has its blocks in ``archs_dsa.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Iterator

from .config import DSA_ARCHES, SynthConfig
from .quant import Role

__all__ = ["Init", "TensorPlan", "plan_tensors"]


class Init(str, Enum):
    W = "weight"
    NORM = "norm"
    BIAS = "bias"
    DECAY = "decay"


@dataclass(frozen=True)
class TensorPlan:
    name: str
    ne: tuple[int, ...]          # ggml order
    role: Role
    init: Init

    @property
    def sigma(self) -> float:
        if self.init is Init.W:
            return 1.0 / math.sqrt(self.ne[0])
        return 0.02 if self.init is Init.BIAS else 0.05

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)


def _w(name: str, ne: tuple[int, ...], role: Role) -> TensorPlan:
    return TensorPlan(name + ".weight", ne, role, Init.W)


def _norm(name: str, n: int) -> TensorPlan:
    return TensorPlan(name + ".weight", (n,), Role.F32, Init.NORM)


def _bias(name: str, ne: tuple[int, ...]) -> TensorPlan:
    return TensorPlan(name + ".bias", ne, Role.F32, Init.BIAS)


def _router(name: str, ne: tuple[int, ...]) -> TensorPlan:
    # F32 like every router, but filled as weights: logits of unit variance route diversely
    return TensorPlan(name + ".weight", ne, Role.F32, Init.W)


def _routed(c: SynthConfig, p: str, order: str = "down,gate,up") -> list[TensorPlan]:
    e, f, x = c.n_embd, c.n_ff_exp, c.n_experts
    parts = {"down": _w(f"{p}.ffn_down_exps", (f, e, x), Role.DOWN),
             "gate": _w(f"{p}.ffn_gate_exps", (e, f, x), Role.EXPERTS),
             "up": _w(f"{p}.ffn_up_exps", (e, f, x), Role.EXPERTS)}
    if c.fuse_gate_up:     # convert --fuse-gate-up-exps emits the fused tensor when up arrives
        return [parts["down"], _w(f"{p}.ffn_gate_up_exps", (e, 2 * f, x), Role.EXPERTS)]
    return [parts[k] for k in order.split(",")]


def _dense(c: SynthConfig, p: str) -> list[TensorPlan]:
    e, f = c.n_embd, c.n_ff
    return [_w(f"{p}.ffn_down", (f, e), Role.DENSE), _w(f"{p}.ffn_gate", (e, f), Role.DENSE),
            _w(f"{p}.ffn_up", (e, f), Role.DENSE)]


def _shexp(c: SynthConfig, p: str) -> list[TensorPlan]:
    e, f = c.n_embd, c.n_ff_exp * c.n_expert_shared
    return [_w(f"{p}.ffn_down_shexp", (f, e), Role.SHEXP), _w(f"{p}.ffn_gate_shexp", (e, f), Role.SHEXP),
            _w(f"{p}.ffn_up_shexp", (e, f), Role.SHEXP)]


def _gqa(c: SynthConfig, p: str, sinks: bool = False) -> list[TensorPlan]:
    """self_attn.{k_norm,k_proj,o_proj,q_norm,q_proj,v_proj} (+ biases, gpt-oss sinks)."""
    e, d = c.n_embd, c.head_dim
    q, kv = d * c.n_head, d * c.n_head_kv
    out: list[TensorPlan] = []
    for x, width, norm in (("k", kv, True), ("output", q, False), ("q", q, True), ("v", kv, False)):
        if x == "output":
            if c.arch == "gpt-oss":
                out.append(_bias(f"{p}.attn_output", (e,)))
            out.append(_w(f"{p}.attn_output", (q, e), Role.ATTN))
            continue
        if norm and c.qk_norm:
            out.append(_norm(f"{p}.attn_{x}_norm", d))
        if c.qkv_bias:
            out.append(_bias(f"{p}.attn_{x}", (width,)))
        out.append(_w(f"{p}.attn_{x}", (e, width), Role.ATTN))
        if x == "q" and sinks:
            out.append(TensorPlan(f"{p}.attn_sinks.weight", (c.n_head,), Role.F32, Init.BIAS))
    return out


def _mla(c: SynthConfig, p: str) -> list[TensorPlan]:
    """DeepSeek MLA: kv_a_layernorm, kv_a_proj_with_mqa, kv_b_proj (split), o_proj, q_a/q_b."""
    e, h = c.n_embd, c.n_head
    kv, nope, rope, v = c.kv_lora_rank, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim
    out = [_norm(f"{p}.attn_kv_a_norm", kv),
           _w(f"{p}.attn_kv_a_mqa", (e, kv + rope), Role.ATTN),
           _w(f"{p}.attn_k_b", (nope, kv, h), Role.ATTN),
           _w(f"{p}.attn_v_b", (kv, v, h), Role.ATTN),
           _w(f"{p}.attn_output", (h * v, e), Role.ATTN)]
    if c.q_lora_rank:
        out += [_norm(f"{p}.attn_q_a_norm", c.q_lora_rank),
                _w(f"{p}.attn_q_a", (e, c.q_lora_rank), Role.ATTN),
                _w(f"{p}.attn_q_b", (c.q_lora_rank, h * (nope + rope)), Role.ATTN)]
    else:
        out.append(_w(f"{p}.attn_q", (e, h * (nope + rope)), Role.ATTN))
    return out


def _nextn_head(c: SynthConfig, p: str) -> list[TensorPlan]:
    e = c.n_embd
    out = [_w(f"{p}.nextn.eh_proj", (2 * e, e), Role.ATTN)]
    if c.nextn_heads:
        out.append(_w(f"{p}.nextn.embed_tokens", (e, c.n_vocab), Role.EMBD))
    return out + [_norm(f"{p}.nextn.enorm", e), _norm(f"{p}.nextn.hnorm", e)]


def _nextn_tail(c: SynthConfig, p: str) -> list[TensorPlan]:
    out = []
    if c.nextn_heads:
        out.append(_w(f"{p}.nextn.shared_head_head", (c.n_embd, c.n_vocab), Role.OUTPUT))
    return out + [_norm(f"{p}.nextn.shared_head_norm", c.n_embd)]


def _block(c: SynthConfig, i: int) -> list[TensorPlan]:
    if c.arch in DSA_ARCHES:
        from .archs_dsa import dsa_block
        return dsa_block(c, i)
    p, e, x = f"blk.{i}", c.n_embd, c.n_experts
    nextn = i >= c.n_layers
    moe = c.is_moe_block(i)
    out = _nextn_head(c, p) if nextn else []
    if c.arch == "qwen3moe":
        out += [_norm(f"{p}.attn_norm", e), *_routed(c, p), _router(f"{p}.ffn_gate_inp", (e, x)),
                _norm(f"{p}.ffn_norm", e), *_gqa(c, p)]
    elif c.arch == "llama":
        # block_sparse_moe.experts.*.{w1,w2,w3} merge as gate, down, up; then .gate (router)
        out += [*_routed(c, p, "gate,down,up"), _router(f"{p}.ffn_gate_inp", (e, x)),
                _norm(f"{p}.attn_norm", e), _norm(f"{p}.ffn_norm", e), *_gqa(c, p)]
    elif c.arch == "glm4moe":
        out.append(_norm(f"{p}.attn_norm", e))
        if moe:
            out += _routed(c, p)
            out += [_bias(f"{p}.exp_probs_b", (x,))] if c.probs_bias else []
            out += [_router(f"{p}.ffn_gate_inp", (e, x))]
            out += _shexp(c, p) if c.n_expert_shared else []
        else:
            out += _dense(c, p)
        out += [_norm(f"{p}.post_attention_norm", e), *_gqa(c, p)]
    elif c.arch == "deepseek2":
        out.append(_norm(f"{p}.attn_norm", e))
        if moe:
            out += _routed(c, p)
            out += [_bias(f"{p}.exp_probs_b", (x,))] if c.probs_bias else []
            out += [_router(f"{p}.ffn_gate_inp", (e, x)), *_shexp(c, p)]
        else:
            out += _dense(c, p)
        out += [_norm(f"{p}.ffn_norm", e), *_mla(c, p)]
    elif c.arch == "gpt-oss":
        f = c.n_ff_exp
        down, gate, up = _routed(c, p)
        out += [_norm(f"{p}.attn_norm", e),
                _bias(f"{p}.ffn_down_exps", (e, x)), down,
                _bias(f"{p}.ffn_gate_exps", (f, x)), gate, _bias(f"{p}.ffn_up_exps", (f, x)), up,
                _bias(f"{p}.ffn_gate_inp", (x,)), _router(f"{p}.ffn_gate_inp", (e, x)),
                _norm(f"{p}.post_attention_norm", e), *_gqa(c, p, sinks=True)]
    else:
        raise AssertionError(c.arch)
    return out + (_nextn_tail(c, p) if nextn else [])


def plan_tensors(c: SynthConfig) -> list[TensorPlan]:
    """Every tensor of the model, in file order."""
    return list(_iter(c))


def _iter(c: SynthConfig) -> Iterator[TensorPlan]:
    yield _w("token_embd", (c.n_embd, c.n_vocab), Role.EMBD)
    for i in range(c.block_count):
        yield from _block(c, i)
    yield _norm("output_norm", c.n_embd)
    yield _w("output", (c.n_embd, c.n_vocab), Role.OUTPUT)
