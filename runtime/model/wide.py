"""Products of many tokens straight from ggml bytes: ``F.linear(x, W)`` for batches wider than
the native several-token kernels take (prefill, verify passes of many tokens).

The weight is dequantized by the native kernels (``runtime.kernels.dequant``: each weight as
the exact kernels and gguf-py give it) in row chunks of about ``CHUNK_ELEMS`` weights, and each
chunk is multiplied by BLAS as soon as it exists, so the float weight never exists whole and a
chunk stays in cache. Where the native kernels do not take the type (or are not built) this is
``formats.dequant.linear``, the same result from the torch dequantization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...formats.dequant import linear as torch_linear
from ...formats.ggml import GGMLType, row_bytes
from .. import kernels as native

__all__ = ["wide_linear", "CHUNK_ELEMS"]

#: Weights dequantized per step (as ``formats.dequant.linear``'s CPU chunk): 4 MiB of float32.
CHUNK_ELEMS = 1 << 20


def wide_linear(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, shape: tuple[int, ...],
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in]`` float32 on CPU → ``F.linear(x, W, bias)`` for W of torch ``shape (out,
    in)`` given as ggml bytes ``raw``."""
    rows, cols = int(shape[0]), int(shape[1])
    step = max(1, CHUNK_ELEMS // max(cols, 1))
    w = None
    if x.dtype == torch.float32 and x.is_cpu and rows:
        mat = raw.reshape(rows, row_bytes(t, cols))
        w = native.dequant(mat[:step], t, (min(step, rows), cols))
    if w is None:
        return torch_linear(x, raw, t, shape, bias)
    if step >= rows:
        return F.linear(x, w, bias)
    parts = [F.linear(x, w)]
    parts += [F.linear(x, native.dequant(mat[r0:r0 + step], t, (min(step, rows - r0), cols)))
              for r0 in range(step, rows, step)]
    y = torch.cat(parts, dim=-1)
    return y if bias is None else y.add_(bias.to(y.dtype))
