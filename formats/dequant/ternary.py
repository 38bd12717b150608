"""The ternary quants TQ1_0 and TQ2_0 (256-element blocks, one fp16 scale ``d`` each).

Layouts (``ggml-common.h``, byte order) and values ``d * (t - 1)``:

- TQ1_0 ``qs[48], qh[4], d:f16``: five base-3 digits per byte, stored as
  ``ceil(v * 256 / 243)`` of the 5-digit number v; digit n of a byte q is
  ``((q * 3**n mod 256) * 3) >> 8``. Elements 0..159 are digit n of ``qs[0..31]`` (n major),
  160..239 digit n of ``qs[32..47]``, 240..255 digit n < 4 of ``qh[0..3]``.
- TQ2_0 ``qs[64], d:f16``: 2-bit codes t (0..3, so 3 gives +2); in each group of 32 bytes,
  element 32·n + j is bits 2n..2n+1 of byte j.

The float32 product is gguf-py's, so results are bit-identical to it.
"""

from __future__ import annotations

import torch

from .fields import bit_planes, f16_field

__all__ = ["dequant_tq1_0", "dequant_tq2_0"]

_POW3 = (1, 3, 9, 27, 81)


def _trits(q: torch.Tensor, digits: int) -> torch.Tensor:
    """``q (n, g)`` uint8 → ``(n, digits · g)`` int32: digit n of every byte, n major."""
    q = q.to(torch.int32).contiguous()
    planes = [(((q * p) & 0xFF) * 3) >> 8 for p in _POW3[:digits]]
    return torch.stack(planes, dim=1).reshape(q.shape[0], -1)


def dequant_tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 52)
    t = torch.cat((_trits(blocks[:, :32], 5), _trits(blocks[:, 32:48], 5),
                   _trits(blocks[:, 48:52], 4)), dim=1)
    return (t - 1).float().mul_(d)


def dequant_tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 64)
    t = bit_planes(blocks[:, :64].reshape(n, 2, 32), (0, 2, 4, 6), 0x03)   # (n, 2, 4, 32)
    return (t.to(torch.int32) - 1).float().reshape(n, 256).mul_(d)
