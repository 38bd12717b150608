"""Torch dequant kernels against gguf-py's numpy ``gguf.quants.dequantize`` (the oracle).

Every supported type is checked bit for bit on random valid blocks (random payload bytes,
finite fp16 scale fields), on several shapes, and for the types gguf-py can quantize also on
``gguf.quants.quantize`` output of random floats. A hypothesis property runs the same
comparison over arbitrary bytes with sanitised scale fields.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants as gq
from hypothesis import HealthCheck, given, settings, strategies as st

from expertfs.errors import ExpertfsError
from expertfs.formats.dequant import (SUPPORTED_TYPES, QuantShapeError, UnsupportedQuantError,
                                      dequantize, linear)
from expertfs.formats.ggml import GGMLType as T, block_size, row_bytes, type_size

ALL = sorted(SUPPORTED_TYPES, key=int)
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.TQ1_0,
               T.TQ2_0]

#: Byte offsets of the fp16 fields (d, dmin, m) inside one block (ggml-common.h).
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
    T.IQ1_S: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,),
}


def sanitise(blocks: np.ndarray, t: T) -> np.ndarray:
    """Make random block bytes a valid, finite block: clear bit 14 of every fp16 scale (its
    top exponent bit), so no scale is inf/NaN and every |scale| < 2. Plain float types get the
    same treatment on every element. MXFP4's E8M0 byte needs none (every value is valid)."""
    b = blocks.copy()
    if t in (T.F16, T.BF16):
        b[:, 1] &= 0xBF
    elif t == T.F32:
        b[:, 3] &= 0xBF
    for off in F16_FIELDS.get(t, ()):
        b[:, off + 1] &= 0xBF
    if t == T.IQ1_M:                      # d's bits 12..15 are the top nibble of byte 55
        b[:, 55] &= 0xBF
    return b


def random_blocks(t: T, rows: int, cols: int, rng: np.random.Generator,
                  moderate: bool = False) -> np.ndarray:
    """Random valid blocks; ``moderate`` also keeps MXFP4 scales near 1 (finite products)."""
    n_blocks = rows * cols // block_size(t)
    raw = sanitise(rng.integers(0, 256, (n_blocks, type_size(t)), dtype=np.uint8), t)
    if moderate and t == T.MXFP4:
        raw[:, 0] = rng.integers(118, 136, n_blocks, dtype=np.uint8)
    return raw.reshape(rows, row_bytes(t, cols))


def reference(raw: np.ndarray, t: T) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # MXFP4 e=255 overflows to inf
        return gq.dequantize(raw, t)


def assert_bit_equal(got: torch.Tensor, ref: np.ndarray) -> None:
    assert got.dtype == torch.float32 and tuple(got.shape) == ref.shape
    g = got.numpy().view(np.uint32)
    r = np.ascontiguousarray(ref, dtype=np.float32).view(np.uint32)
    bad = np.flatnonzero(g != r)
    assert bad.size == 0, (f"{bad.size} of {g.size} differ; first at {bad[0]}: "
                           f"{got.numpy().ravel()[bad[0]]!r} vs {ref.ravel()[bad[0]]!r}")


def shapes_for(t: T) -> list[tuple[int, int]]:
    bs = block_size(t)
    if bs == 1:
        return [(1, 1), (3, 64), (33, 96)]
    return [(1, bs), (1, 8 * bs), (5, 2 * bs), (64, max(512, bs))]


@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_random_blocks_bit_exact(t: T) -> None:
    rng = np.random.default_rng(int(t))
    for rows, cols in shapes_for(t):
        raw = random_blocks(t, rows, cols, rng)
        assert_bit_equal(dequantize(torch.from_numpy(raw), t, (rows, cols)), reference(raw, t))


@pytest.mark.parametrize("t", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_floats_bit_exact(t: T) -> None:
    rng = np.random.default_rng(100 + int(t))
    w = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3.0, (48, 1))).astype(np.float32)
    w[3] = 0.0                            # an all-zero row: zero scales
    raw = gq.quantize(w, t)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(48, -1)
    got = dequantize(torch.from_numpy(raw), t, (48, 256))
    assert_bit_equal(got, reference(raw, t))
    if t == T.F32:
        assert np.array_equal(got.numpy(), w)


@pytest.mark.parametrize("t", [T.Q4_K, T.IQ2_XXS, T.MXFP4, T.F16, T.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_dtype_is_the_rounded_float32(t: T, dtype: torch.dtype) -> None:
    raw = torch.from_numpy(random_blocks(t, 8, 256, np.random.default_rng(7)))
    got = dequantize(raw, t, (8, 256), dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got, dequantize(raw, t, (8, 256)).to(dtype))


def test_expert_slice_of_a_3d_tensor_is_its_linear_weight() -> None:
    # ggml ne = [n_in, n_out, n_experts]; numpy / torch order (n_experts, n_out, n_in)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 16, 256)).astype(np.float32)
    raw = gq.quantize(w, T.Q8_0)                      # (4, 16, 256 / 32 * 34)
    flat = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))
    expert_bytes = 16 * row_bytes(T.Q8_0, 256)
    for e in range(4):
        part = flat[e * expert_bytes:(e + 1) * expert_bytes]
        assert_bit_equal(dequantize(part, T.Q8_0, (16, 256)), gq.dequantize(raw[e], T.Q8_0))
    whole = dequantize(flat, T.Q8_0, (4, 16, 256))
    assert_bit_equal(whole, gq.dequantize(raw, T.Q8_0))


@pytest.mark.parametrize("t", [T.F32, T.F16, T.Q8_0, T.Q4_K, T.IQ2_XS, T.IQ1_M],
                         ids=lambda t: t.name)
def test_misaligned_and_strided_bytes(t: T) -> None:
    """Bytes at an odd offset of a larger buffer, or a strided row view, still decode."""
    rng = np.random.default_rng(11)
    raw = random_blocks(t, 4, 256, rng)
    ref = reference(raw, t)
    buf = torch.zeros(raw.size + 3, dtype=torch.uint8)
    buf[1:1 + raw.size] = torch.from_numpy(raw.reshape(-1))
    assert_bit_equal(dequantize(buf[1:1 + raw.size], t, (4, 256)), ref)
    wide = torch.zeros(4, raw.shape[1] + 5, dtype=torch.uint8)
    wide[:, 1:1 + raw.shape[1]] = torch.from_numpy(raw)
    assert_bit_equal(dequantize(wide[:, 1:1 + raw.shape[1]], t, (4, 256)), ref)


def test_result_never_aliases_the_bytes() -> None:
    raw = torch.from_numpy(np.arange(8, dtype=np.float32).view(np.uint8).copy())
    out = dequantize(raw, T.F32, (2, 4))
    out += 1
    assert torch.equal(raw.view(torch.float32), torch.arange(8, dtype=torch.float32))


def test_type_given_as_int_or_name() -> None:
    raw = torch.from_numpy(random_blocks(T.Q4_0, 2, 64, np.random.default_rng(1)))
    ref = dequantize(raw, T.Q4_0, (2, 64))
    assert torch.equal(dequantize(raw, 2, (2, 64)), ref)
    assert torch.equal(dequantize(raw, "q4_0", (2, 64)), ref)


@pytest.mark.parametrize("bad", [T.Q8_K, T.I8, 999, "nope"])
def test_unsupported_types_are_refused_by_name(bad) -> None:
    with pytest.raises(UnsupportedQuantError) as err:
        dequantize(torch.zeros(292, dtype=torch.uint8), bad, (1, 256))
    assert isinstance(err.value, ValueError) and isinstance(err.value, ExpertfsError)
    name = bad.name if isinstance(bad, T) else repr(bad)
    assert name in str(err.value) and "supported:" in str(err.value)


def test_bad_sizes_name_the_type_and_the_rule() -> None:
    raw = torch.zeros(2 * 144, dtype=torch.uint8)
    with pytest.raises(QuantShapeError, match=r"Q4_K rows of 100 elements .* 256-element blocks"):
        dequantize(raw, T.Q4_K, (1, 100))
    with pytest.raises(QuantShapeError, match=r"Q4_K shape \(3, 256\) needs 432 bytes .* got 288"):
        dequantize(raw, T.Q4_K, (3, 256))
    with pytest.raises(QuantShapeError, match="uint8"):
        dequantize(raw.to(torch.int8), T.Q4_K, (2, 256))
    with pytest.raises(QuantShapeError, match="float dtype"):
        dequantize(raw, T.Q4_K, (2, 256), dtype=torch.int32)
    with pytest.raises(ValueError):
        dequantize(raw, T.Q4_K, ())


def test_empty_tensor() -> None:
    out = dequantize(torch.zeros(0, dtype=torch.uint8), T.Q4_K, (0, 256))
    assert out.shape == (0, 256)


# --- the fused linear -----------------------------------------------------------------------

@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K, T.MXFP4, T.IQ2_XXS, T.Q6_K, T.BF16, T.F32],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 5])
def test_linear_matches_dequantize_then_linear(t: T, batch: int) -> None:
    rng = np.random.default_rng(int(t) + batch)
    rows, cols = 96, 512
    raw = torch.from_numpy(random_blocks(t, rows, cols, rng, moderate=True))
    x = torch.from_numpy(rng.standard_normal((batch, cols)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(rows).astype(np.float32))
    w = dequantize(raw, t, (rows, cols))
    want = F.linear(x, w, bias)
    for chunk in (0, cols * 7, cols * 32, None):      # whole, ragged last chunk, 3 chunks, default
        got = linear(x, raw, t, (rows, cols), bias, chunk_elems=chunk)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * float(w.abs().max()))


def test_linear_bf16_activations_and_leading_dims() -> None:
    rng = np.random.default_rng(5)
    raw = torch.from_numpy(random_blocks(T.Q4_K, 64, 256, rng))
    x = torch.from_numpy(rng.standard_normal((2, 3, 256)).astype(np.float32)).bfloat16()
    got = linear(x, raw, T.Q4_K, (64, 256), chunk_elems=256 * 16)
    want = F.linear(x, dequantize(raw, T.Q4_K, (64, 256), dtype=torch.bfloat16))
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 64)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_linear_uses_a_matching_plain_weight_in_place() -> None:
    w = torch.randn(8, 64).bfloat16()
    raw = w.view(torch.uint8).reshape(-1)
    x = torch.randn(3, 64).bfloat16()
    bias = torch.randn(8)                              # float32 bias follows x's dtype
    assert torch.equal(linear(x, raw, T.BF16, (8, 64), bias), F.linear(x, w, bias.bfloat16()))


def test_linear_rejects_mismatches() -> None:
    raw = torch.zeros(4 * 34, dtype=torch.uint8)
    with pytest.raises(QuantShapeError, match="x has 64 features"):
        linear(torch.zeros(1, 64), raw, T.Q8_0, (4, 32))
    with pytest.raises(QuantShapeError, match="2-D"):
        linear(torch.zeros(1, 32), raw, T.Q8_0, (2, 2, 32))
    with pytest.raises(QuantShapeError, match="bias"):
        linear(torch.zeros(1, 32), raw, T.Q8_0, (4, 32), torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_cuda_matches_cpu(t: T) -> None:
    raw = torch.from_numpy(random_blocks(t, 16, 512 if block_size(t) > 1 else 64,
                                         np.random.default_rng(9)))
    shape = (16, 512 if block_size(t) > 1 else 64)
    cpu = dequantize(raw, t, shape)
    gpu = dequantize(raw.cuda(), t, shape)
    assert torch.equal(gpu.cpu().view(torch.int32), cpu.view(torch.int32))


# --- property: arbitrary bytes --------------------------------------------------------------

@st.composite
def quant_cases(draw):
    t = draw(st.sampled_from(ALL))
    rows = draw(st.integers(1, 3))
    n_cols_blocks = draw(st.integers(1, 3 if block_size(t) > 1 else 40))
    cols = n_cols_blocks * block_size(t)
    size = rows * row_bytes(t, cols)
    payload = draw(st.binary(min_size=size, max_size=size))
    return t, rows, cols, payload


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quant_cases())
def test_property_random_bytes_bit_exact(case) -> None:
    t, rows, cols, payload = case
    blocks = np.frombuffer(payload, dtype=np.uint8).reshape(-1, type_size(t))
    raw = sanitise(blocks, t).reshape(rows, row_bytes(t, cols))
    assert_bit_equal(dequantize(torch.from_numpy(raw), t, (rows, cols)), reference(raw, t))
