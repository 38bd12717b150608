"""F32, F16 and BF16: one element per "block", read by reinterpreting the bytes.

All three are exact: fp16 and bf16 widen to float32 without rounding.
"""

from __future__ import annotations

import torch

from .fields import reinterpret

__all__ = ["dequant_f32", "dequant_f16", "dequant_bf16"]


def dequant_f32(blocks: torch.Tensor) -> torch.Tensor:
    return reinterpret(blocks, torch.float32)


def dequant_f16(blocks: torch.Tensor) -> torch.Tensor:
    return reinterpret(blocks, torch.float16)


def dequant_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return reinterpret(blocks, torch.bfloat16)
