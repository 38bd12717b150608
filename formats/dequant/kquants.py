"""The K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-element super-blocks).

Layouts (``ggml-common.h``, in byte order) and what each kernel computes:

- Q2_K ``scales[16], qs[64], d:f16, dmin:f16``: 16 sub-blocks of 16; the scale byte holds a
  4-bit scale (low) and a 4-bit min (high); value ``(d*sc) * q - (dmin*m)``, q 2 bits.
- Q3_K ``hmask[32], qs[64], scales[12], d:f16``: 16 six-bit signed scales (offset 32) packed
  4+2 bits; q = 2 low bits minus 4 when the hmask bit is clear; value ``(d*sc) * q``.
- Q4_K ``d, dmin:f16, scales[12], qs[128]``: 8 sub-blocks of 32 with 6-bit scales and mins
  (``get_scale_min_k4``); value ``(d*sc) * q - (dmin*m)``, q 4 bits.
- Q5_K ``d, dmin, scales[12], qh[32], qs[128]``: as Q4_K with a fifth bit from qh.
- Q6_K ``ql[128], qh[64], scales:int8[16], d:f16``: value ``(d*sc) * (q - 32)``, q 6 bits.

The float32 operations are gguf-py's, in its order, so results are bit-identical to it.
"""

from __future__ import annotations

import torch

from .fields import bit_planes, f16_field, nibbles

__all__ = ["dequant_q2_k", "dequant_q3_k", "dequant_q4_k", "dequant_q5_k", "dequant_q6_k"]

_BITS8 = tuple(range(8))
_CRUMBS = (0, 2, 4, 6)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes → 8 six-bit scales and 8 six-bit mins (``get_scale_min_k4``), uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d, dmin = f16_field(blocks, 80), f16_field(blocks, 82)
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = bit_planes(blocks[:, 16:80].reshape(n, 2, 32), _CRUMBS, 3).reshape(n, 16, 16)
    return q.float().mul_(dl).sub_(ml).reshape(n, 256)


def dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    d = f16_field(blocks, 108)
    low = bit_planes(scales[:, 0:8], (0, 4), 0x0F).reshape(n, 16)
    high = bit_planes(scales[:, 8:12], _CRUMBS, 0x03).reshape(n, 16)
    sc = ((low | (high << 4)).view(torch.int8) - 32).float()
    dl = (d * sc).reshape(n, 16, 1)
    ql = bit_planes(qs.reshape(n, 2, 32), _CRUMBS, 3).reshape(n, 16, 16)
    qh = bit_planes(hmask.reshape(n, 1, 32), _BITS8, 1).reshape(n, 16, 16) ^ 1
    q = ql.view(torch.int8) - (qh << 2).view(torch.int8)
    return q.float().mul_(dl).reshape(n, 256)


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * mn.float()).reshape(n, 8, 1)
    q = nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)
    return q.float().mul_(dl).sub_(ml).reshape(n, 256)


def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * mn.float()).reshape(n, 8, 1)
    ql = nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = bit_planes(blocks[:, 16:48].reshape(n, 1, 32), _BITS8, 1).reshape(n, 8, 32)
    q = ql | (qh << 4)
    return q.float().mul_(dl).sub_(ml).reshape(n, 256)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = bit_planes(blocks[:, 128:192].reshape(n, 2, 32), _CRUMBS, 3).reshape(n, 8, 32)
    scales = blocks[:, 192:208].view(torch.int8).float()
    d = f16_field(blocks, 208)
    dl = (d * scales).reshape(n, 16, 1)
    q = ((ql | (qh << 4)).view(torch.int8) - 32).reshape(n, 16, 16)
    return q.float().mul_(dl).reshape(n, 256)
