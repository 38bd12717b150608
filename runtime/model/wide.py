"""Products of many tokens straight from ggml bytes: ``F.linear(x, W)`` for batches wider than
the native several-token kernels take (prefill, verify passes of many tokens).

``kernels.qgemm`` (AVX2 or AVX-512): each panel of 24 rows dequantized once into the core's
cache and multiplied by every token there, no float weight written to memory; 1.3-2x the
dequantize-then-BLAS below at 16-64 tokens, about even past 100 (bench/README.md). Under the
portable kernels:
``formats.dequant.linear``'s row chunks (about ``CHUNK_ELEMS`` weights, each multiplied by BLAS
as soon as it exists, so the float weight never exists whole and a chunk stays in cache), with
the chunks dequantized by the native kernels (``runtime.kernels.dequant``: each weight as the
exact kernels and gguf-py give it) where they take the type, else by the torch dequantization:
the same result either way. The native chunks are written into one scratch buffer per thread
(``model.scratch``), reused by every call: a fresh chunk would be new pages each time,
faulted in and zeroed before the dequantization writes them, which cost as much as the
dequantization and the product together (bench/README.md). Each chunk is multiplied by
``gemm.linear`` (the GEMM library chosen for the box).
"""

from __future__ import annotations

import torch

from ...formats.dequant import linear as torch_linear
from ...formats.ggml import GGMLType
from .. import kernels as native
from ..kernels import gemm
from . import scratch

__all__ = ["wide_linear", "dequant_linear", "CHUNK_ELEMS"]

#: Weights dequantized per step (as ``formats.dequant.linear``'s CPU chunk): 4 MiB of float32.
CHUNK_ELEMS = 1 << 20


def wide_linear(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, shape: tuple[int, ...],
                bias: torch.Tensor | None = None, act_quant: str | None = None) -> torch.Tensor:
    """``x [..., in]`` float32 on CPU → ``F.linear(x, W, bias)`` for W of torch ``shape (out,
    in)`` given as ggml bytes ``raw``; ``act_quant="q8"``: q8 mode's numerics where the CPU has
    its integer panel product (``kernels.qgemm``), else exact."""
    y = native.qgemm(x.reshape(-1, int(shape[1])), raw, t, shape, act_quant)   # panels, if
    if y is None:                                                    # the kernels have it
        return dequant_linear(x, raw, t, shape, bias)
    y = y.reshape(*x.shape[:-1], int(shape[0]))
    return y if bias is None else y + bias


def dequant_linear(x: torch.Tensor, raw: torch.Tensor, t: GGMLType, shape: tuple[int, ...],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``wide_linear`` without the panel product: the rows dequantized a chunk at a time into
    this thread's scratch (the native kernels' dequantization where they take the type), each
    chunk multiplied by ``gemm.linear``."""
    cols = int(shape[1])
    native_rows = None
    if x.dtype == torch.float32 and x.is_cpu and \
            native.dequant(raw[:0], t, (0, cols)) is not None:        # the kernels take it
        def native_rows(part: torch.Tensor) -> torch.Tensor:     # used before the next call
            n = part.shape[0]
            out = scratch.buffer("dequant_rows", n * cols)
            return native.dequant(part, t, (n, cols), out=out)
    if native_rows is None:
        return torch_linear(x, raw, t, shape, bias)
    x2 = x.reshape(-1, cols)
    xp = gemm.pad_rows(x2)                      # once, not for every chunk
    y = torch_linear(xp, raw, t, shape, bias, chunk_elems=CHUNK_ELEMS, dequant_rows=native_rows,
                     matmul=gemm.linear)
    return y[:x2.shape[0]].reshape(*x.shape[:-1], int(shape[0]))
