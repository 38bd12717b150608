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

from .fields import bits_per_byte, f16_field, reinterpret, u16_field, word_fields
from .tables import table

__all__ = ["dequant_iq4_nl", "dequant_iq4_xs", "level_pairs"]


def level_pairs(name: str, qs: torch.Tensor) -> torch.Tensor:
    """Groups of 16 code bytes ``(..., 16)`` → ``(..., 32)`` float32 levels in ggml order
    (the low nibbles of the 16 bytes, then the high ones), from the table ``name`` of
    ``tables`` (``iq4nl_pairs`` or ``mxfp4_pairs``).

    Each output pair (2i, 2i+1) is two nibbles of one little-endian 16-bit word, so one
    index per pair picks an int64 table entry holding both float32 values: half the gathers
    of a per-weight lookup (measured faster for the whole kernel on CPU).
    """
    w = reinterpret(qs, torch.int16).contiguous()                      # bytes 2i | 2i+1 << 8
    lo = (w & 0x0F) | ((w >> 4) & 0xF0)                                # low nibbles of both
    hi = ((w >> 4) & 0x0F) | ((w >> 8) & 0xF0)                         # high nibbles of both
    index = torch.stack((lo, hi), dim=-2).to(torch.int32)
    pairs = torch.index_select(table(name, qs.device), 0, index.reshape(-1))
    return pairs.view(torch.float32).reshape(*qs.shape[:-1], 32)


def dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    return level_pairs("iq4nl_pairs", blocks[:, 2:18]).mul_(d)


def dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    high = word_fields(u16_field(blocks[:, 2:4]), tuple(range(0, 16, 2)), 3)
    low = bits_per_byte(blocks[:, 4:8], (0, 4), 0x0F)
    sc = (low | (high.to(torch.uint8) << 4)).view(torch.int8) - 32
    dl = (d * sc.float()).reshape(n, 8, 1)
    levels = level_pairs("iq4nl_pairs", blocks[:, 8:136].reshape(n, 8, 16))   # (n, 8, 32)
    return levels.mul_(dl).reshape(n, 256)
