"""The lattice ("grid") IQ quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

Each group of 8 (IQ2, IQ1) or 4 (IQ3) weights is one entry of a fixed codebook (the grids of
``ggml-common.h``, see ``tables``), multiplied by a per-sub-block scale and, for IQ2/IQ3, by
8 signs. Layouts (byte order) and values:

- IQ2_XXS ``d:f16, qs:u32[16]``: per 32 weights two words: 4 grid bytes, then 4×7 sign bits
  and a 4-bit scale; ``d * (0.5 + s) * 0.25 * grid * sign``.
- IQ2_XS ``d, qs:u16[32], scales[8]``: u16 = 9-bit grid index | 7-bit sign index << 9;
  4-bit scales per 16 weights; same value as IQ2_XXS.
- IQ2_S ``d, qs[32], signs[32], qh[8], scales[8]``: 10-bit index (qs | 2 bits of qh << 8),
  explicit sign bits.
- IQ3_XXS ``d, qs[64], scales:u32[8]``: 8-bit index into a 4-wide grid; the word holds 4×7
  sign bits and a 4-bit scale; ``d * (0.5 + s) * 0.5 * grid * sign``.
- IQ3_S ``d, qs[64], qh[8], signs[32], scales[4]``: 9-bit index; ``d * (1 + 2s) * grid * sign``.
- IQ1_S ``d, qs[32], qh:u16[8]``: 11-bit index (qs | 3 bits of qh << 8); per 32 weights
  ``d * (2 * ((qh >> 12) & 7) + 1) * (grid + (±0.125 by qh bit 15))``.
- IQ1_M ``qs[32], qh[16], scales:u16[4]``: the fp16 d is spread over the top nibbles of the
  four scale words; 3-bit scales per 16 weights, delta sign per 8 weights from qh.

The float32 operations are gguf-py's, in its order (a sign flip and adding ±0.125 to a grid
value in {-1, 0, 1} are exact), so results are bit-identical to it.
"""

from __future__ import annotations

import torch

from .fields import bits_per_byte, f16_field, int32_words, u16_field, word_fields
from .tables import table

__all__ = ["dequant_iq2_xxs", "dequant_iq2_xs", "dequant_iq2_s", "dequant_iq3_xxs",
           "dequant_iq3_s", "dequant_iq1_s", "dequant_iq1_m"]

_BITS8 = tuple(range(8))
_SIGN_SHIFTS = (0, 7, 14, 21)
_NIBBLES = (0, 4)


def _lookup(name: str, index: torch.Tensor) -> torch.Tensor:
    """Rows of table ``name`` for every entry of an integer ``index``: shape ``(*index, width)``."""
    tab = table(name, index.device)
    rows = torch.index_select(tab, 0, index.reshape(-1).to(torch.int32))
    return rows.reshape(*index.shape, tab.shape[1])


def _ksign_index(words: torch.Tensor) -> torch.Tensor:
    """int32 words ``(n, k)`` → ``(n, k, 4)``: the four 7-bit ksigns indices of each word."""
    return word_fields(words, _SIGN_SHIFTS, 0x7F).reshape(*words.shape, 4)




def dequant_iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs = blocks[:, 2:66].reshape(n, 8, 8)
    aux = int32_words(qs[:, :, 4:8]).reshape(n, 8)
    db = (d * (0.5 + ((aux >> 28) & 0xF).float()) * 0.25).reshape(n, 8, 1, 1)
    index = (qs[:, :, 0:4].to(torch.int32) << 7) | _ksign_index(aux)   # (n, 8, 4)
    # gguf-py computes (db * grid) * sign; db * (grid * sign) is the same float (sign flip)
    return _lookup("iq2xxs_signed", index).mul_(db).reshape(n, 256)


def dequant_iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    sc = bits_per_byte(blocks[:, 66:74], _NIBBLES, 0x0F)
    db = (d * (0.5 + sc.float()) * 0.25).reshape(n, 16, 1, 1)
    words = u16_field(blocks[:, 2:66])                                # (n, 32): sign << 9 | grid
    return _lookup("iq2xs_signed", words).reshape(n, 16, 2, 8).mul_(db).reshape(n, 256)


def dequant_iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs, sign_bytes, qh = blocks[:, 2:34], blocks[:, 34:66], blocks[:, 66:74]
    sc = bits_per_byte(blocks[:, 74:82], _NIBBLES, 0x0F)
    db = (d * (0.5 + sc.float()) * 0.25).reshape(n, 16, 1, 1)
    high = bits_per_byte(qh, (0, 2, 4, 6), 3)
    index = qs.to(torch.int32) | (high.to(torch.int32) << 8)
    grid = _lookup("iq2s", index).reshape(n, 16, 2, 8)
    signs = _lookup("signs8", sign_bytes).reshape(n, 16, 2, 8)
    return grid.mul_(db).mul_(signs).reshape(n, 256)          # gguf-py: db * grid * signs


def dequant_iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    words = int32_words(blocks[:, 66:98]).reshape(n, 8)
    db = (d * (0.5 + ((words >> 28) & 0xF).float()) * 0.5).reshape(n, 8, 1)
    # 4 ksigns bytes per 32 weights, one sign nibble per 4-wide grid entry
    nib = _lookup("ksign_nibbles", _ksign_index(words)).reshape(n, 64)
    index = (blocks[:, 2:66].to(torch.int32) << 4) | nib.to(torch.int32)
    # gguf-py's (db * grid) * sign equals db * (grid * sign): a sign flip is exact
    return _lookup("iq3xxs_signed", index).reshape(n, 8, 32).mul_(db).reshape(n, 256)


def dequant_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs, qh, sign_bytes = blocks[:, 2:66], blocks[:, 66:74], blocks[:, 74:106]
    sc = bits_per_byte(blocks[:, 106:110], _NIBBLES, 0x0F)
    db = (d * (1 + 2 * sc).float()).reshape(n, 8, 1)
    high = bits_per_byte(qh, _BITS8, 1)
    nib = bits_per_byte(sign_bytes, _NIBBLES, 0x0F)                   # (n, 64)
    index = (qs.to(torch.int32) << 4) | (high.to(torch.int32) << 12) | nib.to(torch.int32)
    return _lookup("iq3s_signed", index).reshape(n, 8, 32).mul_(db).reshape(n, 256)


def dequant_iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qh = u16_field(blocks[:, 34:50])                                  # (n, 8) int32
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1)
    high = word_fields(qh, (0, 3, 6, 9), 7).reshape(n, 8, 4)
    index = (blocks[:, 2:34].to(torch.int32).reshape(n, 8, 4) | (high << 8)) << 1
    index |= ((qh >> 15) & 1).reshape(n, 8, 1)                        # delta sign bit
    # gguf-py computes dl * (grid + delta); the table holds grid + delta
    return _lookup("iq1s_delta", index).reshape(n, 8, 32).mul_(dl).reshape(n, 256)


def dequant_iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qs, qh, sc_bytes = blocks[:, 0:32], blocks[:, 32:48], blocks[:, 48:56]
    top = sc_bytes[:, 1::2] >> 4                                      # top nibble of each u16
    d_bytes = torch.stack((top[:, 0] | (top[:, 1] << 4), top[:, 2] | (top[:, 3] << 4)), dim=-1)
    d = d_bytes.view(torch.float16).float()                           # (n, 1)
    sc = word_fields(u16_field(sc_bytes), (0, 3, 6, 9), 7)            # (n, 16)
    dl = (d * (2 * sc + 1).float()).reshape(n, 16, 1)
    halves = bits_per_byte(qh, _NIBBLES, 0x0F).to(torch.int32)        # (n, 32): per 8 weights
    index = ((qs.to(torch.int32) | ((halves & 7) << 8)) << 1) | (halves >> 3)
    return _lookup("iq1s_delta", index).reshape(n, 16, 16).mul_(dl).reshape(n, 256)
