"""``linear``: ``F.linear(x, W)`` straight from the ggml bytes of W.

On CPU the weight is dequantized in row chunks of about ``chunk_elems`` elements and each
chunk is multiplied as soon as it exists, so the float weight never exists whole: the chunk's
temporaries stay in the L2/L3 cache and are recycled by the allocator, instead of several
matrix-sized float32 temporaries being paged in for every call: measured faster than
``F.linear(x, dequantize(...))`` on one thread and no consistent loss on two
(``bench/bench_dequant.py``; figures in bench/README.md). On other devices the whole matrix is
one chunk by default (not measured: no GPU was available).

A weight stored as F32/F16/BF16 whose dtype equals ``x.dtype`` is used in place (no copy).

The product is computed in ``x.dtype``: float32 activations give the float32 result of
``F.linear(x, dequantize(raw, ...))`` (up to the summation order of the BLAS); bfloat16 or
float16 activations multiply bfloat16/float16 weights (rounded from the exact float32
dequant, as ``dequantize(..., dtype=x.dtype)`` would give).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..ggml import GGMLType, row_bytes, type_size
from .dispatch import KERNELS, check_bytes, dequantize, resolve_type
from .errors import QuantShapeError

__all__ = ["linear", "DEFAULT_CPU_CHUNK_ELEMS"]

_PLAIN = frozenset((GGMLType.F32, GGMLType.F16, GGMLType.BF16))

#: Weight elements dequantized per step on CPU (the best or tied-best of 2**18 ... 2**22 for
#: every type measured, see bench/bench_dequant.py): 1 Mi elements = 4 MiB f32.
DEFAULT_CPU_CHUNK_ELEMS = 1 << 20


def _check(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, dims: tuple[int, ...],
           bias: torch.Tensor | None) -> None:
    if len(dims) != 2:
        raise QuantShapeError(f"{t.name} linear needs a 2-D weight shape (out, in), got {dims}")
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise QuantShapeError(f"{t.name} linear needs floating-point activations x")
    if x.shape[-1] != dims[1]:
        raise QuantShapeError(f"{t.name} linear: x has {x.shape[-1]} features, "
                              f"the weight {dims} takes {dims[1]}")
    if x.device != raw.device:
        raise QuantShapeError(
            f"{t.name} linear: x is on {x.device}, the weight bytes on {raw.device}")
    if bias is not None and tuple(bias.shape) != (dims[0],):
        raise QuantShapeError(
            f"{t.name} linear: bias shape {tuple(bias.shape)} is not ({dims[0]},)")


def linear(x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLType | int | str,
           shape: Sequence[int], bias: torch.Tensor | None = None, *,
           chunk_elems: int | None = None,
           dequant_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
           matmul: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """``F.linear(x, W, bias)`` where W ``(out, in)`` is given as ggml bytes ``raw``.

    ``shape`` is W's torch shape ``(out, in)`` (ggml ``ne=[in, out]``); ``x`` is ``(..., in)``
    on ``raw``'s device; the result is ``(..., out)`` in ``x.dtype``. ``chunk_elems`` caps the
    weight elements dequantized at once (default: ``DEFAULT_CPU_CHUNK_ELEMS`` on CPU, the
    whole matrix elsewhere; ``0`` also means the whole matrix). ``dequant_rows``, if given,
    dequantizes whole rows instead of this package's kernels: their bytes ``[n, row_bytes]`` → float32
    ``[n, in]`` (the runtime's native kernels; the same values). ``matmul(x, w, bias)`` multiplies
    each float chunk (``F.linear``; the runtime passes the GEMM library it chose for the box).
    """
    t = resolve_type(ggml_type)
    dims = check_bytes(raw, t, shape)
    _check(x, raw, t, dims, bias)
    if bias is not None:
        bias = bias.to(x.dtype)
    rows, cols = dims
    if t in _PLAIN and raw.numel():
        w = KERNELS[t](raw.reshape(-1, type_size(t))).reshape(dims)
        if w.dtype == x.dtype:
            return matmul(x, w, bias)
    if chunk_elems is None:
        chunk_elems = DEFAULT_CPU_CHUNK_ELEMS if raw.device.type == "cpu" else 0
    step = max(1, chunk_elems // max(cols, 1)) if chunk_elems > 0 else rows
    if rows == 0 or cols == 0 or (step >= rows and dequant_rows is None):
        return matmul(x, dequantize(raw, t, dims, dtype=x.dtype), bias)
    mat = raw.reshape(rows, row_bytes(t, cols))
    if dequant_rows is None:
        kernel, tsize = KERNELS[t], type_size(t)

        def dequant_rows(part: torch.Tensor) -> torch.Tensor:
            return kernel(part.reshape(-1, tsize)).reshape(part.shape[0], cols)
    if step >= rows:
        return matmul(x, dequant_rows(mat).to(x.dtype), bias)
    parts = [matmul(x, dequant_rows(mat[r0:r0 + step]).to(x.dtype))
             for r0 in range(0, rows, step)]
    y = torch.cat(parts, dim=-1)
    return y if bias is None else y.add_(bias)
