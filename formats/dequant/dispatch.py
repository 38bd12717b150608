"""The dispatch table and ``dequantize``: ggml bytes → a float torch tensor.

A kernel maps ``(n_blocks, type_size)`` uint8 → ``(n_blocks, block_size)`` float32 (the plain
float types return their own dtype). ``dequantize`` checks that bytes, shape and type agree,
reshapes, calls the kernel and casts. Pure torch: the same code runs on CPU and CUDA.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..ggml import GGMLType, block_size, row_bytes, type_size
from .errors import QuantShapeError, UnsupportedQuantError
from .iq4 import dequant_iq4_nl, dequant_iq4_xs
from .iq_grid import (dequant_iq1_m, dequant_iq1_s, dequant_iq2_s, dequant_iq2_xs,
                      dequant_iq2_xxs, dequant_iq3_s, dequant_iq3_xxs)
from .kquants import dequant_q2_k, dequant_q3_k, dequant_q4_k, dequant_q5_k, dequant_q6_k
from .legacy import dequant_q4_0, dequant_q4_1, dequant_q5_0, dequant_q5_1, dequant_q8_0
from .mxfp4 import dequant_mxfp4
from .simple import dequant_bf16, dequant_f16, dequant_f32
from .ternary import dequant_tq1_0, dequant_tq2_0

__all__ = ["KERNELS", "SUPPORTED_TYPES", "dequantize", "dequantize_blocks", "resolve_type",
           "check_bytes"]

Kernel = Callable[[torch.Tensor], torch.Tensor]

T = GGMLType
KERNELS: dict[GGMLType, Kernel] = {
    T.F32: dequant_f32, T.F16: dequant_f16, T.BF16: dequant_bf16,
    T.Q4_0: dequant_q4_0, T.Q4_1: dequant_q4_1, T.Q5_0: dequant_q5_0, T.Q5_1: dequant_q5_1,
    T.Q8_0: dequant_q8_0,
    T.Q2_K: dequant_q2_k, T.Q3_K: dequant_q3_k, T.Q4_K: dequant_q4_k, T.Q5_K: dequant_q5_k,
    T.Q6_K: dequant_q6_k,
    T.IQ2_XXS: dequant_iq2_xxs, T.IQ2_XS: dequant_iq2_xs, T.IQ2_S: dequant_iq2_s,
    T.IQ3_XXS: dequant_iq3_xxs, T.IQ3_S: dequant_iq3_s, T.IQ1_S: dequant_iq1_s,
    T.IQ1_M: dequant_iq1_m, T.IQ4_NL: dequant_iq4_nl, T.IQ4_XS: dequant_iq4_xs,
    T.MXFP4: dequant_mxfp4, T.TQ1_0: dequant_tq1_0, T.TQ2_0: dequant_tq2_0,
}
del T

_PLAIN = frozenset((GGMLType.F32, GGMLType.F16, GGMLType.BF16))

#: The ggml types ``dequantize`` accepts.
SUPPORTED_TYPES = frozenset(KERNELS)


def resolve_type(ggml_type: GGMLType | int | str) -> GGMLType:
    """A ``GGMLType`` from an enum member, its integer id or its name; typed error if none."""
    try:
        if isinstance(ggml_type, str):
            t = GGMLType[ggml_type.upper()]
        else:
            t = GGMLType(int(ggml_type))
    except (KeyError, ValueError, TypeError):
        raise UnsupportedQuantError(f"{ggml_type!r} is not a ggml type",
                                    fix=_supported_hint()) from None
    if t not in KERNELS:
        raise UnsupportedQuantError(f"no torch dequant kernel for ggml type {t.name}",
                                    fix=_supported_hint()) from None
    return t


def _supported_hint() -> str:
    return "supported: " + ", ".join(t.name for t in sorted(KERNELS, key=int))


def check_bytes(raw: torch.Tensor, t: GGMLType, shape: Sequence[int]) -> tuple[int, ...]:
    """Validate ``raw`` against ``shape`` (torch order, last axis = ggml ne[0]); the shape."""
    if not isinstance(raw, torch.Tensor):
        raise QuantShapeError(f"{t.name} bytes must be a torch.Tensor, got {type(raw).__name__}")
    if raw.dtype != torch.uint8:
        raise QuantShapeError(f"{t.name} bytes must be a uint8 tensor, got {raw.dtype}",
                              fix="pass the raw ggml bytes, "
                                  "e.g. torch.frombuffer(buf, dtype=torch.uint8)")
    dims = tuple(int(s) for s in shape)
    if not dims or any(s < 0 for s in dims):
        raise QuantShapeError(
            f"{t.name} shape {tuple(shape)} must have at least one axis and no negative size")
    cols = dims[-1]
    bs = block_size(t)
    if cols % bs:
        raise QuantShapeError(
            f"{t.name} rows of {cols} elements are not a whole number of {bs}-element blocks",
            fix=f"the last axis (ggml ne[0]) must be a multiple of {bs}")
    rows = 1
    for s in dims[:-1]:
        rows *= s
    need = rows * row_bytes(t, cols)
    if raw.numel() != need:
        raise QuantShapeError(
            f"{t.name} shape {dims} needs {need} bytes ({rows} rows × {row_bytes(t, cols)} B), "
            f"got {raw.numel()}")
    return dims


def dequantize_blocks(blocks: torch.Tensor, t: GGMLType) -> torch.Tensor:
    """Kernel output for ``(n_blocks, type_size)`` uint8 blocks: ``(n_blocks, block_size)``."""
    return KERNELS[t](blocks)


def dequantize(raw: torch.Tensor, ggml_type: GGMLType | int | str, shape: Sequence[int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize the ggml bytes ``raw`` of a tensor of torch ``shape`` into ``dtype``.

    ``raw``: uint8, any shape, holding ``prod(shape[:-1])`` rows of whole blocks (for an
    expert slice with ggml ``ne=[n_in, n_out]`` pass ``shape=(n_out, n_in)``: the result is
    the ``nn.Linear`` weight). The result lives on ``raw``'s device. Quantized types are
    computed in float32 and cast to ``dtype`` at the end; the values equal gguf-py's numpy
    ``dequantize`` bit for bit. The result never shares memory with ``raw``.
    """
    t = resolve_type(ggml_type)
    dims = check_bytes(raw, t, shape)
    if not dtype.is_floating_point:
        raise QuantShapeError(f"{t.name} can only be dequantized to a float dtype, not {dtype}")
    n_blocks = raw.numel() // type_size(t)
    if n_blocks == 0:
        return torch.empty(dims, dtype=dtype, device=raw.device)
    out = KERNELS[t](raw.reshape(n_blocks, type_size(t))).reshape(dims)
    if out.dtype == dtype and t in _PLAIN:
        return out.clone()          # the plain kernels return a view of raw: never alias it
    return out.to(dtype)
