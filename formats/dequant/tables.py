"""Lookup tables of the non-linear ggml types, taken from gguf-py and cached per device.

The IQ grids (``iq2xxs_grid`` ... ``iq1s_grid`` in llama.cpp's ``ggml-common.h``), the
``ksigns_iq2xs`` parity table and the 16-level value tables of IQ4_NL/IQ4_XS and MXFP4 are
llama.cpp facts. gguf-py (llama.cpp's own Python package) carries them in ``gguf.quants``;
they are decoded from there once, never copied by hand, and cached as float32 torch tensors
per device so a kernel's table lookup is one ``index_select``.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
from gguf import quants as _gq

__all__ = ["table", "TABLE_NAMES"]


def _grid(cls: type) -> np.ndarray:
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    return grid


def _sign_bytes() -> np.ndarray:
    """(256, 8): entry b holds -1.0 where bit i of b is set, else +1.0 (element i = bit i)."""
    b = np.arange(256, dtype=np.uint8).reshape(-1, 1) >> np.arange(8, dtype=np.uint8)
    return np.where(b & 1, np.float32(-1), np.float32(1)).astype(np.float32)


def _ksigns() -> np.ndarray:
    """(128, 8): the 7-bit sign index of IQ2_XXS/IQ2_XS/IQ3_XXS expanded through ksigns_iq2xs."""
    ks = np.frombuffer(_gq.IQ2_XXS.ksigns, dtype=np.uint8)
    return _sign_bytes()[ks]


def _e8m0_half() -> np.ndarray:
    """(256,): ``ggml_e8m0_to_fp32_half`` for every exponent byte, built the way ggml builds it."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _signed_grid(grid: str, index_of: str) -> np.ndarray:
    """A grid fused with the ksigns table: one row per (grid index, 7-bit sign index) pair.

    ``index_of == "xxs"``: row ``g << 7 | s`` (IQ2_XXS builds that index from its bytes);
    ``"u16"``: row = the raw IQ2_XS word ``s << 9 | g``. A row is ``grid[g] * ksigns[s]``,
    exact (a sign flip), and saves a second gather and a multiply per 8 weights.
    """
    g = _BUILDERS[grid]()
    rows = g[:, None, :] * _ksigns()[None, :, :]                 # (G, 128, 8)
    if index_of == "u16":
        rows = rows.transpose(1, 0, 2)                             # (128, G, 8): s << 9 | g
    return rows.reshape(-1, 8)


def _signed_grid4(grid: str) -> np.ndarray:
    """A 4-wide grid fused with 4 sign bits: row ``g << 4 | s`` = ``grid[g]`` with element i
    negated where bit i of s is set (IQ3_XXS, IQ3_S: one sign nibble per grid entry)."""
    g = _BUILDERS[grid]()
    signs = _sign_bytes()[:16, :4]                                 # (16, 4)
    return (g[:, None, :] * signs[None, :, :]).reshape(-1, 4)


def _ksign_nibbles() -> np.ndarray:
    """(128, 2) uint8-valued: the low and high nibble of ``ksigns_iq2xs[k]``."""
    ks = np.frombuffer(_gq.IQ2_XXS.ksigns, dtype=np.uint8)
    return np.stack((ks & 0x0F, ks >> 4), axis=-1)


def _level_pairs(levels: tuple[int, ...]) -> np.ndarray:
    """(256,) int64: entry b packs the float32 values of nibbles ``b & 15`` (low word) and
    ``b >> 4`` (high word), so one 1-D gather yields two weights (read it as float32)."""
    kv = np.asarray(levels, dtype=np.float32)
    b = np.arange(256)
    pairs = np.stack((kv[b & 15], kv[b >> 4]), axis=-1)              # (256, 2) float32
    return np.ascontiguousarray(pairs).view(np.int64).reshape(256)


def _delta_grid() -> np.ndarray:
    """IQ1 grid fused with its delta bit: row ``g << 1 | b`` = ``grid[g] + (b ? -1 : 1) * 0.125``
    (IQ1S_DELTA), the float32 sum gguf-py forms before scaling (exact: grid is in {-1, 0, 1})."""
    g = _BUILDERS["iq1s"]()
    delta = np.array([0.125, -0.125], dtype=np.float32).reshape(1, 2, 1)
    return (g[:, None, :] + delta).astype(np.float32).reshape(-1, 8)


_BUILDERS = {
    "iq2xxs": lambda: _grid(_gq.IQ2_XXS),
    "iq2xs": lambda: _grid(_gq.IQ2_XS),
    "iq2s": lambda: _grid(_gq.IQ2_S),
    "iq3xxs": lambda: _grid(_gq.IQ3_XXS),
    "iq3s": lambda: _grid(_gq.IQ3_S),
    "iq1s": lambda: _grid(_gq.IQ1_S),
    "ksigns": _ksigns,
    "signs8": _sign_bytes,
    "e8m0_half": _e8m0_half,
    "iq2xxs_signed": lambda: _signed_grid("iq2xxs", "xxs"),
    "iq2xs_signed": lambda: _signed_grid("iq2xs", "u16"),
    "iq3xxs_signed": lambda: _signed_grid4("iq3xxs"),
    "iq3s_signed": lambda: _signed_grid4("iq3s"),
    "ksign_nibbles": _ksign_nibbles,
    "iq1s_delta": _delta_grid,
    "iq4nl_pairs": lambda: _level_pairs(_gq.IQ4_NL.kvalues),
    "mxfp4_pairs": lambda: _level_pairs(_gq.MXFP4.kvalues),
}

#: Expected shapes: a gguf-py whose tables differ is refused rather than silently used.
_SHAPES = {
    "iq2xxs": (256, 8), "iq2xs": (512, 8), "iq2s": (1024, 8), "iq3xxs": (256, 4),
    "iq3s": (512, 4), "iq1s": (2048, 8), "ksigns": (128, 8), "signs8": (256, 8),
    "e8m0_half": (256,),
    "iq2xxs_signed": (256 * 128, 8), "iq2xs_signed": (512 * 128, 8),
    "iq3xxs_signed": (256 * 16, 4), "iq3s_signed": (512 * 16, 4), "ksign_nibbles": (128, 2),
    "iq1s_delta": (2048 * 2, 8), "iq4nl_pairs": (256,), "mxfp4_pairs": (256,),
}

TABLE_NAMES = tuple(_BUILDERS)
_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _host(name: str) -> torch.Tensor:
    arr = _BUILDERS[name]()
    if arr.shape != _SHAPES[name]:
        raise RuntimeError(f"gguf-py table {name} has shape {arr.shape}, expected {_SHAPES[name]}")
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr))


@functools.lru_cache(maxsize=None)
def _on(name: str, device: torch.device) -> torch.Tensor:
    _log.debug("building dequant table %s on %s", name, device)
    return _host(name).to(device)


def table(name: str, device: torch.device) -> torch.Tensor:
    """The table ``name`` (one of ``TABLE_NAMES``) on ``device``, built once: float32 values,
    except ``ksign_nibbles`` (uint8 indices) and the ``*_pairs`` tables (int64 words holding
    two float32 values each)."""
    return _on(name, torch.device(device))
