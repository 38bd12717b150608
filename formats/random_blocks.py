"""Random but valid ggml blocks for every quant type common in MoE GGUFs, at a chosen scale.

Two kinds of type:

- *Native*: gguf-py can quantize it (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4).
  Blocks are made by quantizing Gaussian weights of standard deviation ``sigma``.
- *Synthetic*: K-quants and IQ-quants, which gguf-py only dequantizes. A block is random payload
  bytes with every scale field overwritten by a sane finite value: the f16 ``d`` (and ``dmin``,
  chosen so the mean is about zero), or IQ1_M's f16 scale packed into the top nibbles of its
  ``scales``. The factor from ``d`` to the weights' standard deviation is measured once per type
  with gguf-py's own dequantizer, so the dequantised weights have about the intended std.

Every scale gets a per-block jitter of ±20%, as real blocks do. All randomness comes from the
``numpy.random.Generator`` passed in, so a caller that seeds per chunk gets bytes that do not
depend on chunk order or chunk size of other tensors.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from gguf import quants

from ..errors import UsageError
from .ggml import GGMLType, block_size, type_size

__all__ = ["NATIVE_TYPES", "SYNTHETIC_TYPES", "SUPPORTED_TYPES", "native_blocks", "synthetic_blocks",
           "make_blocks", "unit_scale", "check_supported"]

T = GGMLType

NATIVE_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4)

# byte offsets of the f16 ``d`` and ``dmin`` fields in one block (ggml-common.h layouts)
_SCALE_FIELDS: dict[GGMLType, tuple[int, int | None]] = {
    T.Q2_K: (80, 82),       # scales[16] qs[64] d dmin
    T.Q3_K: (108, None),    # hmask[32] qs[64] scales[12] d
    T.Q4_K: (0, 2),         # d dmin scales[12] qs[128]
    T.Q5_K: (0, 2),         # d dmin scales[12] qh[32] qs[128]
    T.Q6_K: (208, None),    # ql[128] qh[64] scales[16] d
    T.IQ2_XXS: (0, None),
    T.IQ2_XS: (0, None),
    T.IQ2_S: (0, None),
    T.IQ3_XXS: (0, None),
    T.IQ3_S: (0, None),
    T.IQ1_S: (0, None),
    T.IQ4_NL: (0, None),
    T.IQ4_XS: (0, None),
}
_IQ1_M_SCALES = 48          # qs[32] qh[16] scales[8]: the f16 scale is the top nibble of 4 u16

SYNTHETIC_TYPES = tuple(_SCALE_FIELDS) + (T.IQ1_M,)
SUPPORTED_TYPES = NATIVE_TYPES + SYNTHETIC_TYPES

_JITTER = 0.2
_CALIB_BLOCKS = 2048
# IQ4_NL's 16 levels are asymmetric (-127 .. 113); llama.cpp's quantizer gives d either sign
_SIGNED_D = frozenset({T.IQ4_NL})


def check_supported(t: GGMLType, where: str = "") -> None:
    if t not in SUPPORTED_TYPES:
        known = ", ".join(x.name for x in SUPPORTED_TYPES)
        raise UsageError(f"ggml type {t.name}{where} cannot be synthesized",
                         fix=f"use one of {known}")


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` uniformly random bytes, at the bit generator's raw speed (GB/s)."""
    raw = rng.bit_generator.random_raw((n + 7) // 8)
    return raw.view(np.uint8)[:n]


def _jitter(rng: np.random.Generator, n: int, signed: bool = False) -> np.ndarray:
    u = rng.random(n, dtype=np.float32)
    j = np.float32(1.0 - _JITTER) + np.float32(2 * _JITTER) * u
    if signed:
        j[rng.random(n, dtype=np.float32) < 0.5] *= -1
    return j


def _put_f16(blocks: np.ndarray, off: int, values: np.ndarray) -> None:
    blocks[:, off:off + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _put_iq1m_scale(blocks: np.ndarray, values: np.ndarray) -> None:
    # IQ1_M has no d field: d's f16 bits are split over the top nibbles of 4 uint16 scales
    bits = values.astype(np.float16).view(np.uint16)
    sc = blocks[:, _IQ1_M_SCALES:_IQ1_M_SCALES + 8].copy().view("<u2").reshape(-1, 4)
    for j in range(4):
        sc[:, j] = (sc[:, j] & np.uint16(0x0FFF)) | (((bits >> np.uint16(4 * j)) & np.uint16(0xF))
                                                     << np.uint16(12))
    blocks[:, _IQ1_M_SCALES:_IQ1_M_SCALES + 8] = sc.view(np.uint8).reshape(-1, 8)


def _set_scales(t: GGMLType, blocks: np.ndarray, d: np.ndarray, dmin_ratio: float) -> None:
    if t == T.IQ1_M:
        _put_iq1m_scale(blocks, d)
        return
    d_off, m_off = _SCALE_FIELDS[t]
    _put_f16(blocks, d_off, d)
    if m_off is not None:
        _put_f16(blocks, m_off, d * dmin_ratio)


def _dequant_mean_std(t: GGMLType, blocks: np.ndarray) -> tuple[float, float]:
    w = quants.dequantize(blocks, t)
    return float(w.mean(dtype=np.float64)), float(w.std(dtype=np.float64))


@lru_cache(maxsize=None)
def unit_scale(t: GGMLType) -> tuple[float, float]:
    """``(d_per_sigma, dmin_ratio)`` for a synthetic type, measured with gguf-py's dequantizer.

    ``d = sigma * d_per_sigma * jitter`` gives weights of standard deviation about ``sigma``;
    ``dmin = d * dmin_ratio`` cancels the positive offset of the unsigned K-quants (Q2_K,
    Q4_K, Q5_K) so the mean is about zero.
    """
    rng = np.random.Generator(np.random.PCG64(0x5EED_0000 + int(t)))
    ts = type_size(t)
    payload = _random_bytes(rng, _CALIB_BLOCKS * ts).reshape(_CALIB_BLOCKS, ts)
    jit = _jitter(rng, _CALIB_BLOCKS, t in _SIGNED_D)
    ratio = 0.0
    if t in _SCALE_FIELDS and _SCALE_FIELDS[t][1] is not None:
        d_off, m_off = _SCALE_FIELDS[t]
        b = payload.copy()
        _put_f16(b, d_off, jit)
        _put_f16(b, m_off, np.zeros_like(jit))
        mean_d, _ = _dequant_mean_std(t, b)
        _put_f16(b, d_off, np.zeros_like(jit))
        _put_f16(b, m_off, jit)
        mean_m, _ = _dequant_mean_std(t, b)
        ratio = -mean_d / mean_m
    b = payload.copy()
    _set_scales(t, b, jit, ratio)
    _, std = _dequant_mean_std(t, b)
    return 1.0 / std, ratio


def synthetic_blocks(t: GGMLType, n_blocks: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """``n_blocks`` random valid blocks of a K- or IQ-quant type, as uint8 ``(n_blocks, size)``."""
    ts = type_size(t)
    per_sigma, ratio = unit_scale(t)
    blocks = _random_bytes(rng, n_blocks * ts).reshape(n_blocks, ts)
    d = _jitter(rng, n_blocks, t in _SIGNED_D) * np.float32(sigma * per_sigma)
    _set_scales(t, blocks, d, ratio)
    return blocks


def native_blocks(t: GGMLType, n_blocks: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian weights (std ``sigma``) quantized by gguf-py, as uint8 ``(n_blocks, size)``.

    Plain float types count one element as a block.
    """
    bs = block_size(t)
    w = rng.standard_normal(n_blocks * bs, dtype=np.float32)
    w *= np.float32(sigma)
    if t == T.F32:
        return w.view(np.uint8).reshape(n_blocks, 4)
    if t == T.F16:
        return w.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if t == T.BF16:
        return quants.quantize(w, t).view(np.uint8).reshape(n_blocks, 2)
    return quants.quantize(w.reshape(n_blocks, bs), t).reshape(n_blocks, type_size(t))


def make_blocks(t: GGMLType, n_blocks: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of any supported type with weights of about ``sigma`` std and zero mean."""
    if t in NATIVE_TYPES:
        return native_blocks(t, n_blocks, sigma, rng)
    check_supported(t)
    return synthetic_blocks(t, n_blocks, sigma, rng)
