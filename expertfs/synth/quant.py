"""Which ggml type each tensor gets: roles, the ``--quant`` spec language, presets, fallbacks.

A spec is comma-separated items applied left to right:

- a preset name (``default``, ``q4_k_m``, ``mixed``, ...) sets every role;
- a bare type name (``Q8_0``) sets every role to that type;
- ``role=TYPE`` sets one role. Roles: ``embd`` (token_embd, nextn.embed_tokens), ``output``
  (output, nextn.shared_head_head), ``attn`` (attention projections, nextn.eh_proj),
  ``experts`` (routed gate/up, fused gate_up), ``down`` (routed down), ``down_more`` (routed
  down on the layers llama-quantize's ``use_more_bits`` picks: the first and last eighth and
  every third between; ``down``'s type unless set), ``shexp`` (shared expert), ``dense``
  (leading dense FFN), ``kda`` (the KDA linear-attention matrices of glm5-next), ``indexer``
  (the DSA indexer's ``attn_k``/``attn_q_b``).

Norms, biases, the router (``ffn_gate_inp``), ``exp_probs_b``, attention sinks, the mHC mixing
weights (``hc_*``), ``ssm_a``, ``ssm_dt``, ``ssm_conv1d_*``, ``indexer.proj`` and
``indexer_compressor_*`` are always F32, as ``convert_hf_to_gguf`` and ``llama-quantize`` write
them.

A tensor whose rows are not a whole number of the chosen type's blocks gets llama-quantize's
fallback type (``tensor_type_fallback`` in src/llama-quant.cpp), then F16 if that does not fit.

``mixed`` gives routed experts and the trunk two independent rotations through ``MIXED_TYPES``
(every type common in MoE GGUFs), so a model with ``ceil(23 / 3) = 8`` MoE layers has every
type among its expert tensors and every type somewhere in its trunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gguf import LlamaFileType

from ..errors import UsageError
from ..formats.ggml import GGMLType, block_size, parse_type
from ..formats.random_blocks import SUPPORTED_TYPES

__all__ = ["Role", "QuantSpec", "parse_quant", "MIXED_TYPES", "PRESETS", "fallback_type",
           "file_type", "use_more_bits"]

T = GGMLType


class Role(str, Enum):
    EMBD = "embd"
    OUTPUT = "output"
    ATTN = "attn"
    EXPERTS = "experts"
    DOWN = "down"
    SHEXP = "shexp"
    DENSE = "dense"
    KDA = "kda"
    INDEXER = "indexer"
    DOWN_MORE = "down_more"
    F32 = "f32"            # norms, biases, router, mixing weights, sinks: never quantized


QUANT_ROLES = tuple(r for r in Role if r is not Role.F32)
EXPERT_ROLES = (Role.EXPERTS, Role.DOWN, Role.DOWN_MORE)
_FILLED = tuple(r for r in QUANT_ROLES if r is not Role.DOWN_MORE)   # down_more follows down

MIXED_TYPES = (T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4, T.IQ2_XXS, T.Q5_K, T.Q3_K, T.IQ4_XS, T.Q2_K,
               T.IQ3_XXS, T.F16, T.Q4_0, T.IQ1_S, T.IQ2_S, T.Q5_0, T.IQ3_S, T.BF16, T.IQ2_XS,
               T.Q4_1, T.IQ4_NL, T.IQ1_M, T.Q5_1, T.F32)


def _all(t: GGMLType) -> dict[Role, GGMLType]:
    return {r: t for r in _FILLED}


def _preset(base: GGMLType, **over: GGMLType) -> dict[Role, GGMLType]:
    d = _all(base)
    d.update({Role(k): v for k, v in over.items()})
    return d


#: Named starting points (never a bare type name). ``default`` is a Q4_K_M-like mix that keeps
#: attention at Q8_0; with it the ``--like`` models come out 6-12% larger than their real
#: Q4_K_M files, which put only some ``ffn_down`` tensors in Q6_K.
PRESETS: dict[str, dict[Role, GGMLType]] = {
    "default": _preset(T.Q8_0, experts=T.Q4_K, down=T.Q6_K, embd=T.Q6_K, output=T.Q6_K,
                       shexp=T.Q8_0, dense=T.Q8_0),
    "q4_k_m": _preset(T.Q4_K, down=T.Q6_K, output=T.Q6_K),
    "q3_k_m": _preset(T.Q3_K, down=T.Q4_K, attn=T.Q4_K, output=T.Q6_K),
    "iq2_m": _preset(T.IQ2_S, down=T.IQ3_S, attn=T.Q4_K, embd=T.Q4_K, output=T.Q6_K),
    "mxfp4_moe": _preset(T.Q8_0, experts=T.MXFP4, down=T.MXFP4),
    # the community GLM-5.3-Flash Maya-S-v2 mix: IQ2_XXS gate/up, IQ2_S down with IQ3_XXS on
    # the use_more_bits layers, Q6_K trunk, Q8_0 KDA and indexer matrices (F32 as listed above)
    "maya-s": _preset(T.Q6_K, experts=T.IQ2_XXS, down=T.IQ2_S, down_more=T.IQ3_XXS, kda=T.Q8_0,
                      indexer=T.Q8_0),
}


@dataclass(frozen=True)
class QuantSpec:
    """A parsed spec: a type per role, or ``mixed`` rotations for roles left unset."""

    roles: tuple[tuple[Role, GGMLType], ...]
    mixed: bool = False
    text: str = ""

    def role_type(self, role: Role) -> GGMLType | None:
        d = dict(self.roles)
        if role is Role.DOWN_MORE and role not in d:
            role = Role.DOWN
        return d.get(role)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quantize's choice of layers that get a better ``ffn_down`` (src/llama-quant.cpp)."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def parse_quant(text: str) -> QuantSpec:
    """Parse ``experts=Q4_K,down=Q6_K,attn=Q8_0`` (see the module docstring)."""
    roles: dict[Role, GGMLType] = dict(PRESETS["default"])
    mixed = False
    for raw in str(text).split(","):
        item = raw.strip()
        if not item:
            continue
        if "=" in item:
            key, _, val = item.partition("=")
            try:
                role = Role(key.strip().lower())
            except ValueError:
                role = None
            if role is None or role is Role.F32:
                names = ", ".join(r.value for r in QUANT_ROLES)
                raise UsageError(f"--quant: unknown tensor role {key.strip()!r}",
                                 fix=f"roles are {names}")
            roles[role] = _type(val.strip())
            continue
        low = item.lower()
        if low == "mixed":
            mixed, roles = True, {}
        elif low in PRESETS:
            mixed, roles = False, dict(PRESETS[low])
        else:
            mixed, roles = False, _all(_type(item))
    return QuantSpec(tuple(sorted(roles.items(), key=lambda kv: QUANT_ROLES.index(kv[0]))),
                     mixed, str(text))


def _type(name: str) -> GGMLType:
    try:
        t = parse_type(name)
    except ValueError:
        t = None
    if t is None or t not in SUPPORTED_TYPES:
        known = ", ".join(x.name for x in SUPPORTED_TYPES)
        presets = ", ".join(list(PRESETS) + ["mixed"])
        raise UsageError(f"--quant: {name!r} is not a type synth can write",
                         fix=f"types: {known}; presets: {presets}")
    return t


# llama-quantize's tensor_type_fallback: 256-element types fall back to 32-element ones
_FALLBACK = {
    T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL,
    T.IQ2_S: T.IQ4_NL, T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL,
    T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
}


def fallback_type(t: GGMLType, ne0: int) -> GGMLType:
    """The type llama-quantize would store for rows of ``ne0`` elements when ``t`` was asked."""
    if ne0 % block_size(t) == 0:
        return t
    alt = _FALLBACK.get(t, t)
    return alt if ne0 % block_size(alt) == 0 else T.F16


# general.file_type for a file whose routed experts are mostly of one type
_FILE_TYPE = {
    T.F32: LlamaFileType.ALL_F32, T.F16: LlamaFileType.MOSTLY_F16,
    T.BF16: LlamaFileType.MOSTLY_BF16, T.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    T.Q4_1: LlamaFileType.MOSTLY_Q4_1, T.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    T.Q5_0: LlamaFileType.MOSTLY_Q5_0, T.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    T.Q2_K: LlamaFileType.MOSTLY_Q2_K, T.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
    T.Q4_K: LlamaFileType.MOSTLY_Q4_K_M, T.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
    T.Q6_K: LlamaFileType.MOSTLY_Q6_K, T.IQ2_XXS: LlamaFileType.MOSTLY_IQ2_XXS,
    T.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS, T.IQ2_S: LlamaFileType.MOSTLY_IQ2_S,
    T.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS, T.IQ3_S: LlamaFileType.MOSTLY_IQ3_S,
    T.IQ1_S: LlamaFileType.MOSTLY_IQ1_S, T.IQ1_M: LlamaFileType.MOSTLY_IQ1_M,
    T.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL, T.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
    T.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
}


def file_type(spec: QuantSpec) -> LlamaFileType:
    """``general.file_type``: named after the routed experts' type, ``GUESSED`` when mixed."""
    t = spec.role_type(Role.EXPERTS)
    if spec.mixed or t is None:
        return LlamaFileType.GUESSED
    return _FILE_TYPE[t]
