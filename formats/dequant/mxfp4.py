"""MXFP4 (OCP microscaling FP4, as in gpt-oss): 32-element blocks ``e:E8M0, qs[16]``.

Each nibble is an e2m1 code; ggml keeps the 16 e2m1 values doubled as integers
(``kvalues_mxfp4`` = 0, 1, 2, 3, 4, 6, 8, 12 and their negatives) and halves the shared scale
instead: ``value_j = ggml_e8m0_to_fp32_half(e) * kvalues[q_j]``, low nibbles are elements
0..15. Both factors are exact in float32 and their product is a power-of-two multiple of a
small integer, so the result is exact (and bit-identical to gguf-py).
"""

from __future__ import annotations

import torch

from .iq4 import level_pairs
from .tables import table

__all__ = ["dequant_mxfp4"]


def dequant_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scale = torch.index_select(table("e8m0_half", blocks.device), 0,
                               blocks[:, 0].to(torch.int32)).reshape(n, 1)
    return level_pairs("mxfp4_pairs", blocks[:, 1:17]).mul_(scale)
