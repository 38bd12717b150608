"""The ggml type table, taken from gguf-py (llama.cpp's own) rather than copied by hand.

``GGMLType`` is gguf-py's ``GGMLQuantizationType``. The one known error in the PyPI wheel
(Q8_1 listed as 40 bytes a block, not 36) is corrected here; Q8_1 never appears in files.
"""

from __future__ import annotations

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGMLType

__all__ = ["GGMLType", "block_size", "type_size", "row_bytes", "tensor_nbytes", "type_name",
           "parse_type", "MAX_DIMS", "FILE_TYPES"]

MAX_DIMS = 4  # GGML_MAX_DIMS

_SIZES: dict[GGMLType, tuple[int, int]] = dict(GGML_QUANT_SIZES)
_SIZES[GGMLType.Q8_1] = (32, 36)  # ggml-common.h static_assert; the PyPI wheel says 40

#: Types that can appear in a model file (Q8_1 and Q8_K are intermediate-only in ggml).
FILE_TYPES = frozenset(t for t in GGMLType if t not in (GGMLType.Q8_1, GGMLType.Q8_K))


def block_size(t: GGMLType) -> int:
    """Elements per block (1 for plain float and integer types)."""
    return _SIZES[t][0]


def type_size(t: GGMLType) -> int:
    """Bytes per block."""
    return _SIZES[t][1]


def type_name(t: int) -> str:
    try:
        return GGMLType(t).name
    except ValueError:
        return f"type#{t}"


def parse_type(name: str) -> GGMLType:
    """``"q4_k"`` or ``"Q4_K"`` → ``GGMLType.Q4_K``; ``ValueError`` naming the known types."""
    try:
        return GGMLType[name.upper()]
    except KeyError:
        known = ", ".join(t.name for t in sorted(FILE_TYPES, key=int))
        raise ValueError(f"unknown ggml type {name!r}; known: {known}") from None


def row_bytes(t: GGMLType, ne0: int) -> int:
    """Bytes of one row of ``ne0`` elements; ``ne0`` must be a whole number of blocks."""
    bs, ts = _SIZES[t]
    if ne0 % bs:
        raise ValueError(f"row of {ne0} elements is not a whole number of {t.name} blocks of {bs}")
    return ne0 // bs * ts


def tensor_nbytes(t: GGMLType, ne: tuple[int, ...] | list[int]) -> int:
    """``ggml_nbytes`` of a contiguous tensor with ggml dims ``ne`` (ne[0] fastest varying)."""
    n = row_bytes(t, ne[0])
    for d in ne[1:]:
        n *= d
    return n
