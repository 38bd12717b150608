"""Typed errors of the dequant kernels.

Both are ``ExpertfsError`` (the CLI turns them into one line and exit status 2) and
``ValueError`` (so plain library callers can catch the familiar type).
"""

from __future__ import annotations

from ...errors import FormatError, UnsupportedModelError

__all__ = ["UnsupportedQuantError", "QuantShapeError"]


class UnsupportedQuantError(UnsupportedModelError, ValueError):
    """A ggml type that has no torch kernel here (or is no ggml type at all)."""


class QuantShapeError(FormatError, ValueError):
    """Bytes, shape and ggml type disagree: not whole blocks, wrong byte count, wrong dtype."""
