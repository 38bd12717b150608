"""The lattice IQ types' codebooks for the native kernels, taken from gguf-py at load.

The grids (``iq2xxs_grid`` ... ``iq1s_grid`` of llama.cpp's ``ggml-common.h``), the
``ksigns_iq2xs`` table and ``kvalues_iq4nl`` are llama.cpp facts that gguf-py (llama.cpp's
own Python package) carries in ``gguf.quants``, the same source ``formats.dequant.tables``
uses. They are handed to the extension as bytes (each grid entry as ggml packs it: byte j is
element j), never copied by hand into the C++ sources.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from gguf import quants as _gq

__all__ = ["install", "TABLES"]

#: Table name → (gguf-py class, expected grid shape); ``ksigns`` and ``kvalues_iq4nl`` apart.
TABLES = {
    "iq2xxs": (_gq.IQ2_XXS, (256, 8)), "iq2xs": (_gq.IQ2_XS, (512, 8)),
    "iq2s": (_gq.IQ2_S, (1024, 8)), "iq3xxs": (_gq.IQ3_XXS, (256, 4)),
    "iq3s": (_gq.IQ3_S, (512, 4)), "iq1s": (_gq.IQ1_S, (2048, 8)),
}


def _bytes(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).reshape(-1).copy())


def _grid(cls: type, shape: tuple[int, int]) -> np.ndarray:
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float32).reshape(shape)
    q = g.astype(np.int8)
    if not np.array_equal(q.astype(np.float32), g):
        raise RuntimeError(f"gguf-py grid of {cls.__name__} is not int8-valued")
    return q


def install(mod: ModuleType) -> None:
    """Hand every table to the loaded extension ``mod``; RuntimeError if one is refused."""
    for name, (cls, shape) in TABLES.items():
        mod.set_iq_table(name, _bytes(_grid(cls, shape)))
    mod.set_iq_table("ksigns", _bytes(np.frombuffer(_gq.IQ2_XXS.ksigns, dtype=np.uint8)))
    mod.set_iq_table("kvalues_iq4nl", _bytes(np.asarray(_gq.IQ4_NL.kvalues, dtype=np.int8)))
    if not mod.info()["iq_tables"]:
        raise RuntimeError("the IQ tables were not all accepted")
