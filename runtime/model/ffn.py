"""SwiGLU feed-forward blocks: dense (leading dense layers, shared experts) and one routed expert.

``y = W_down (silu(W_gate x) * W_up x)`` (llama.cpp ``LLM_FFN_SILU`` + ``LLM_FFN_PAR``). A routed
expert comes either as the provider's ``ExpertWeights`` (ggml bytes, multiplied through
``dequant.linear``) or as a ``FloatExpert`` from the dequantized-expert cache; a fused
``gate_up`` part is split in rows ``[0, n_ff)`` = gate and ``[n_ff, 2 n_ff)`` = up.
A ``limit`` > 0 is llama.cpp's ``swiglu_clamp`` (glm5-next's ``swiglu_clamp_exp``/``_shexp``):
``silu(min(gate, limit)) * clamp(up, -limit, limit)``. An ``alpha`` > 0 is gpt-oss's variant
(llama.cpp ``swiglu_oai``): ``g · sigmoid(alpha · g) · (u + 1)`` on the clamped ``g``, ``u``.
An expert's bias parts (gpt-oss: ``GATE_BIAS``, ``UP_BIAS``, ``DOWN_BIAS``, its own row of the
``ffn_*_exps.bias`` tensors) are added after their matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from ...formats.dequant import dequantize, linear as qlinear
from ...formats.ggml import GGMLType
from ...formats.moe_names import Role
from ..experts.protocol import ExpertWeights, QWeight
from ..kernels import gemm
from .qmatvec import decode_matvec
from .wide import wide_linear
from .weights import Linear

__all__ = ["DenseFFN", "FloatExpert", "EXPERT_PARTS", "expert_ffn", "swiglu", "to_float_expert"]


@dataclass
class DenseFFN:
    gate: Linear
    up: Linear
    down: Linear
    limit: float = 0.0                 # swiglu clamp; 0 = none

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate(x), self.up(x), self.limit))


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float = 0.0,
           alpha: float = 0.0) -> torch.Tensor:
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    if alpha > 0:
        return g * torch.sigmoid(g * alpha) * (u + 1)
    return F.silu(g) * u


@dataclass
class FloatExpert:
    """A routed expert dequantized into the compute dtype, ``[out, in]`` per matrix."""

    parts: Mapping[Role, torch.Tensor]
    nbytes: int


def _q(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    return qlinear(x, w.raw, w.ggml_type, w.shape, matmul=gemm.linear)


def _qf(x: torch.Tensor, w: QWeight, act_quant: str | None = None) -> torch.Tensor:
    y = decode_matvec(x, w.raw, w.ggml_type, w.shape, act_quant)
    return wide_linear(x, w.raw, w.ggml_type, w.shape, act_quant=act_quant) if y is None else y


def _bias(y: torch.Tensor, b: QWeight | torch.Tensor | None) -> torch.Tensor:
    """``y + b`` for an expert's bias part (ggml bytes or a float tensor), ``y`` if none."""
    if b is None:
        return y
    if isinstance(b, QWeight):
        b = b.raw.view(torch.float32) if b.ggml_type == GGMLType.F32 else \
            dequantize(b.raw, b.ggml_type, b.shape, dtype=torch.float32)
    return y + b.to(y.dtype)


def expert_ffn(x: torch.Tensor, e: ExpertWeights | FloatExpert, fused: bool = False,
               act_quant: str | None = None, limit: float = 0.0,
               alpha: float = 0.0) -> torch.Tensor:
    """``x [T, n_embd]`` → ``[T, n_embd]`` through one routed expert. ``fused``: products of
    one token (up to the type's native limit, ``kernels.max_tokens``, with the native kernels)
    go through ``qmatvec`` where the type has one, wider ones through ``wide.wide_linear``;
    ``act_quant="q8"`` there uses llama.cpp's 8-bit activations (native kernels only);
    ``limit``/``alpha``: ``swiglu``'s; bias parts are added (gpt-oss)."""
    p = e.parts
    if isinstance(e, FloatExpert):
        lin = gemm.linear
    elif fused:
        def lin(x: torch.Tensor, w: QWeight) -> torch.Tensor:
            return _qf(x, w, act_quant)
    else:
        lin = _q
    gu = p.get(Role.GATE_UP)
    if gu is not None:
        g, u = lin(x, gu).chunk(2, dim=-1)
    else:
        g = _bias(lin(x, p[Role.GATE]), p.get(Role.GATE_BIAS))
        u = _bias(lin(x, p[Role.UP]), p.get(Role.UP_BIAS))
    return _bias(lin(swiglu(g, u, limit, alpha), p[Role.DOWN]), p.get(Role.DOWN_BIAS))


#: the parts of a routed expert a float expert holds (its matrices and bias rows)
EXPERT_PARTS = (Role.GATE, Role.UP, Role.GATE_UP, Role.DOWN, Role.GATE_BIAS, Role.UP_BIAS,
                Role.DOWN_BIAS)


def to_float_expert(e: ExpertWeights, dtype: torch.dtype) -> FloatExpert:
    """Dequantize every matrix (and bias) of ``e`` (on its device) into ``dtype``."""
    parts = {}
    n = 0
    for role in EXPERT_PARTS:
        w = e.parts.get(role)
        if w is None:
            continue
        t = dequantize(w.raw, w.ggml_type, w.shape, dtype=dtype)
        parts[role] = t
        n += t.numel() * t.element_size()
    return FloatExpert(parts, n)
