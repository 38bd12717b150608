"""The non-linear 4-bit quants: IQ4_NL (32-element blocks) and IQ4_XS (256-element blocks).

Each 4-bit code selects one of 16 fixed levels (``kvalues_iq4nl`` = -127 ... 113, see
``tables``). Layouts (byte order) and values:

- IQ4_NL ``d:f16, qs[16]``: ``d * kvalues[q_j]``, low nibbles are elements 0..15.
- IQ4_XS ``d:f16, scales_h:u16, scales_l[4], qs[128]``: 8 sub-blocks of 32, each with a
  6-bit scale (low 4 bits in ``scales_l``, high 2 bits in ``scales_h``) offset by 32;
  ``(d * (sc - 32)) * kvalues[q_j]``.

The float32 operations are gguf-py's, in its order, so results are bit-identical to it.
"""

from __future__ import annotations

import torch

from .fields import bits_per_byte, f16_field, nibbles, u16_field, word_fields
from .tables import table

__all__ = ["dequant_iq4_nl", "dequant_iq4_xs", "levels"]


def levels(name: str, codes: torch.Tensor) -> torch.Tensor:
    """float32 values of the 16-level table ``name`` for the 4-bit ``codes`` (any shape)."""
    tab = table(name, codes.device)
    out = torch.index_select(tab, 0, codes.reshape(-1).to(torch.int32))
    return out.reshape(codes.shape)


def dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    q = nibbles(blocks[:, 2:18]).reshape(n, 32)
    return levels("iq4nl", q).mul_(d)


def dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    high = word_fields(u16_field(blocks[:, 2:4]), tuple(range(0, 16, 2)), 3)
    low = bits_per_byte(blocks[:, 4:8], (0, 4), 0x0F)
    sc = (low | (high.to(torch.uint8) << 4)).view(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 8, 1)
    q = nibbles(blocks[:, 8:136].reshape(n, 8, 16)).reshape(n, 8, 32)
    return levels("iq4nl", q).mul_(dl).reshape(n, 256)
