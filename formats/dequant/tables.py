"""Lookup tables of the non-linear ggml types, taken from gguf-py and cached per device.

The IQ grids (``iq2xxs_grid`` ... ``iq1s_grid`` in llama.cpp's ``ggml-common.h``), the
``ksigns_iq2xs`` parity table and the 16-level value tables of IQ4_NL/IQ4_XS and MXFP4 are
llama.cpp facts. gguf-py (llama.cpp's own Python package) carries them in ``gguf.quants``;
they are decoded from there once, never copied by hand, and cached as float32 torch tensors
per device so a kernel's table lookup is one ``index_select``.
"""

from __future__ import annotations

import functools

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


_BUILDERS = {
    "iq2xxs": lambda: _grid(_gq.IQ2_XXS),
    "iq2xs": lambda: _grid(_gq.IQ2_XS),
    "iq2s": lambda: _grid(_gq.IQ2_S),
    "iq3xxs": lambda: _grid(_gq.IQ3_XXS),
    "iq3s": lambda: _grid(_gq.IQ3_S),
    "iq1s": lambda: _grid(_gq.IQ1_S),
    "ksigns": _ksigns,
    "signs8": _sign_bytes,
    "iq4nl": lambda: np.asarray(_gq.IQ4_NL.kvalues, dtype=np.float32),
    "mxfp4": lambda: np.asarray(_gq.MXFP4.kvalues, dtype=np.float32),
    "e8m0_half": _e8m0_half,
}

#: Expected shapes: a gguf-py whose tables differ is refused rather than silently used.
_SHAPES = {
    "iq2xxs": (256, 8), "iq2xs": (512, 8), "iq2s": (1024, 8), "iq3xxs": (256, 4),
    "iq3s": (512, 4), "iq1s": (2048, 8), "ksigns": (128, 8), "signs8": (256, 8),
    "iq4nl": (16,), "mxfp4": (16,), "e8m0_half": (256,),
}

TABLE_NAMES = tuple(_BUILDERS)


@functools.lru_cache(maxsize=None)
def _host(name: str) -> torch.Tensor:
    arr = _BUILDERS[name]()
    if arr.shape != _SHAPES[name]:
        raise RuntimeError(f"gguf-py table {name} has shape {arr.shape}, expected {_SHAPES[name]}")
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


@functools.lru_cache(maxsize=None)
def _on(name: str, device: torch.device) -> torch.Tensor:
    return _host(name).to(device)


def table(name: str, device: torch.device) -> torch.Tensor:
    """The float32 table ``name`` (one of ``TABLE_NAMES``) on ``device``, built once."""
    return _on(name, torch.device(device))
