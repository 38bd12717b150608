"""SwiGLU feed-forward blocks: dense (leading dense layers, shared experts) and one routed expert.

``y = W_down (silu(W_gate x) * W_up x)`` (llama.cpp ``LLM_FFN_SILU`` + ``LLM_FFN_PAR``). A routed
expert comes either as the provider's ``ExpertWeights`` (ggml bytes, multiplied through
``dequant.linear``) or as a ``FloatExpert`` from the dequantized-expert cache; a fused
``gate_up`` part is split in rows ``[0, n_ff)`` = gate and ``[n_ff, 2 n_ff)`` = up.
A ``limit`` > 0 is llama.cpp's ``swiglu_clamp`` (glm5-next's ``swiglu_clamp_exp``/``_shexp``):
``silu(min(gate, limit)) * clamp(up, -limit, limit)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from ...formats.dequant import dequantize, linear as qlinear
from ...formats.moe_names import Role
from ..experts.protocol import ExpertWeights, QWeight
from .qmatvec import decode_matvec
from .weights import Linear

__all__ = ["DenseFFN", "FloatExpert", "expert_ffn", "swiglu", "to_float_expert"]


@dataclass
class DenseFFN:
    gate: Linear
    up: Linear
    down: Linear
    limit: float = 0.0                 # swiglu clamp; 0 = none

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate(x), self.up(x), self.limit))


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.silu(g) * u


@dataclass
class FloatExpert:
    """A routed expert dequantized into the compute dtype, ``[out, in]`` per matrix."""

    parts: Mapping[Role, torch.Tensor]
    nbytes: int


def _q(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    return qlinear(x, w.raw, w.ggml_type, w.shape)


def _qf(x: torch.Tensor, w: QWeight, act_quant: str | None = None) -> torch.Tensor:
    y = decode_matvec(x, w.raw, w.ggml_type, w.shape, act_quant)
    return qlinear(x, w.raw, w.ggml_type, w.shape) if y is None else y


def expert_ffn(x: torch.Tensor, e: ExpertWeights | FloatExpert, fused: bool = False,
               act_quant: str | None = None, limit: float = 0.0) -> torch.Tensor:
    """``x [T, n_embd]`` → ``[T, n_embd]`` through one routed expert. ``fused``: products of
    one token (up to ``qmatvec.NATIVE_MAX_TOKENS`` with the native kernels) go through
    ``qmatvec`` where the type has one;
    ``act_quant="q8"`` there uses llama.cpp's 8-bit activations (native kernels only)."""
    p = e.parts
    if isinstance(e, FloatExpert):
        lin = F.linear
    elif fused:
        def lin(x: torch.Tensor, w: QWeight) -> torch.Tensor:
            return _qf(x, w, act_quant)
    else:
        lin = _q
    gu = p.get(Role.GATE_UP)
    if gu is not None:
        g, u = lin(x, gu).chunk(2, dim=-1)
    else:
        g, u = lin(x, p[Role.GATE]), lin(x, p[Role.UP])
    return lin(swiglu(g, u, limit), p[Role.DOWN])


_MATRICES = (Role.GATE, Role.UP, Role.GATE_UP, Role.DOWN)


def to_float_expert(e: ExpertWeights, dtype: torch.dtype) -> FloatExpert:
    """Dequantize every matrix of ``e`` (on its device) into ``dtype``."""
    parts = {}
    n = 0
    for role in _MATRICES:
        w = e.parts.get(role)
        if w is None:
            continue
        t = dequantize(w.raw, w.ggml_type, w.shape, dtype=dtype)
        parts[role] = t
        n += t.numel() * t.element_size()
    return FloatExpert(parts, n)
