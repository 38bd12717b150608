"""The 32-element legacy block quants: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Layouts (``ggml-common.h``), value of element j:

- Q4_0 ``d:f16, qs[16]``          ``d * (q_j - 8)``,  q_j = nibble j (low nibbles = 0..15)
- Q4_1 ``d:f16, m:f16, qs[16]``   ``d * q_j + m``
- Q5_0 ``d:f16, qh:u32, qs[16]``  ``d * (q_j - 16)``, q_j = nibble j | bit j of qh << 4
- Q5_1 ``d, m:f16, qh:u32, qs[16]`` ``d * q_j + m``
- Q8_0 ``d:f16, qs:int8[32]``     ``d * qs_j``

Each kernel does the float32 operations of gguf-py's numpy reference in the same order, so
the results are bit-identical to it (the integer offsets are applied before the multiply,
never folded into a fused multiply-add).
"""

from __future__ import annotations

import torch

from .fields import bits_per_byte, f16_field, nibbles

__all__ = ["dequant_q4_0", "dequant_q4_1", "dequant_q5_0", "dequant_q5_1", "dequant_q8_0"]

_BITS8 = tuple(range(8))


def _q4(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes → 32 uint8 nibbles in element order, shape (n, 32)."""
    return nibbles(qs).reshape(qs.shape[0], 32)


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """4 high-bit bytes + 16 nibble bytes → 32 five-bit values (uint8), shape (n, 32)."""
    high = bits_per_byte(qh, _BITS8, 1)
    return _q4(qs) | (high << 4)


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    q = _q4(blocks[:, 2:18]).view(torch.int8) - 8
    return q.float().mul_(d)


def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    return _q4(blocks[:, 4:20]).float().mul_(d).add_(m)


def dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    q = _q5(blocks[:, 2:6], blocks[:, 6:22]).view(torch.int8) - 16
    return q.float().mul_(d)


def dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    return _q5(blocks[:, 4:8], blocks[:, 8:24]).float().mul_(d).add_(m)


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    return blocks[:, 2:34].view(torch.int8).float().mul_(d)
