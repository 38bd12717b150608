"""The native dequantization (``kernels.dequant``) gives every weight of every native type bit
for bit as gguf-py's ``quants.dequantize`` does, and ``dequant_linear`` (the products of batches
wider than the several-token kernels, without the panel product) equals
``formats.dequant.linear`` exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from expertfs.formats.dequant import linear as torch_linear
from expertfs.formats.ggml import GGMLType, block_size
from expertfs.formats.random_blocks import make_blocks
from expertfs.runtime import kernels
from expertfs.runtime.kernels import gemm
from expertfs.runtime.model.wide import CHUNK_ELEMS, dequant_linear, wide_linear
from support.native import NEEDS_NATIVE

pytestmark = NEEDS_NATIVE

TYPES = sorted(kernels.TYPES, key=int)


def weight(t: GGMLType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid bytes: gguf-py's quantization of random floats where it quantizes the type, else
    random valid blocks."""
    rng = np.random.default_rng(seed)
    try:
        q = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), T(int(t)))
        return torch.from_numpy(np.ascontiguousarray(q).view(np.uint8).reshape(-1).copy())
    except (NotImplementedError, ValueError, KeyError):
        n = rows * cols // block_size(t)
        return torch.from_numpy(make_blocks(t, n, 0.05, rng).reshape(-1).copy()).view(torch.uint8)


def cols_of(t: GGMLType) -> int:
    return 512 if block_size(t) <= 256 else block_size(t) * 2


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequant_equals_gguf_py(t):
    rows, cols = 24, cols_of(t)
    raw = weight(t, rows, cols, int(t))
    want = quants.dequantize(raw.numpy().reshape(rows, -1), T(int(t))).astype(np.float32)
    got = kernels.dequant(raw, t, (rows, cols))
    assert got is not None and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), want.reshape(rows, cols), equal_nan=True)


@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.IQ2_XXS,
                               GGMLType.MXFP4], ids=lambda t: t.name)
def test_dequant_linear_equals_the_torch_path(t):
    """``dequant_linear`` (``wide_linear`` where the kernels have no panel product) equals the
    torch path bit for bit: the same floats, the same chunks, the same BLAS products. Where the
    panel product runs (``wide_linear`` on a vector ISA) its sums are in another order:
    within float32 rounding of them (``test_qgemm.py`` checks it per type and ISA)."""
    cols = 512
    rows = CHUNK_ELEMS // cols * 2 + 40                 # three chunks, the last one short
    raw = weight(t, rows, cols, 7)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
    mm = gemm.linear                                    # the same float32 products on both sides
    want = torch_linear(x, raw, t, (rows, cols), bias, matmul=mm)
    assert torch.equal(dequant_linear(x, raw, t, (rows, cols), bias), want)
    small = raw[:8 * len(raw) // rows]                    # one chunk
    assert torch.equal(dequant_linear(x, small, t, (8, cols)),
                       torch_linear(x, small, t, (8, cols), matmul=mm))
    got = wide_linear(x, raw, t, (rows, cols), bias)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


def test_dequant_into_a_buffer_writes_its_head():
    """``out=``: the same floats, written into the first rows * cols of a larger scratch
    buffer (its storage, no new tensor); a buffer too small or of another dtype is refused."""
    t, rows, cols = GGMLType.Q4_K, 24, 512
    raw = weight(t, rows, cols, 5)
    buf = torch.full((rows * cols + 100,), 7.0)
    got = kernels.dequant(raw, t, (rows, cols), out=buf)
    assert got.shape == (rows, cols) and got.data_ptr() == buf.data_ptr()
    assert torch.equal(got, kernels.dequant(raw, t, (rows, cols)))
    assert torch.equal(buf[rows * cols:], torch.full((100,), 7.0))
    for bad in (torch.empty(rows * cols - 1), torch.empty(rows * cols, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="dequant_into"):
            kernels.dequant(raw, t, (rows, cols), out=bad)


def test_dequant_refuses_what_it_does_not_take():
    raw = torch.zeros(2 * 32 * 4, dtype=torch.uint8)
    assert kernels.dequant(raw, GGMLType.F32, (2, 32)) is None


@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.IQ2_XXS,
                               GGMLType.F16, GGMLType.F32], ids=lambda t: t.name)
def test_embedding_lookup_equals_the_torch_path(t):
    """The token embedding's rows (``Embedding.lookup``, native on the CPU where the type has a
    kernel) are the torch dequantization's floats in every dtype, repeated ids included."""
    from expertfs.formats.dequant import dequantize
    from expertfs.runtime.model.weights import Embedding, RawTensor
    rows, cols = 40, cols_of(t)
    raw = weight(t, rows, cols, 3)
    emb = Embedding(RawTensor("token_embd.weight", raw, t, (rows, cols)), torch.device("cpu"))
    ids = torch.tensor([5, 39, 0, 5])
    for dtype in (torch.float32, torch.bfloat16):
        want = dequantize(emb.rows.index_select(0, ids), t, (4, cols), dtype=dtype)
        got = emb.lookup(ids, dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)
