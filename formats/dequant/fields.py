"""Reading the fields of ggml blocks out of a ``(n_blocks, type_size)`` uint8 tensor.

Every kernel receives its blocks as one 2-D uint8 tensor, one block per row, and slices the
fields of the block layout (``ggml-common.h``) out of it with these helpers. They are pure torch
and device-agnostic; ggml data is little-endian, as is every host torch runs on.

Only the small scale fields are copied (to make a dtype view legal); the payload (``qs``)
stays a strided uint8 view until the kernel's first arithmetic pass.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["f16_field", "int32_words", "u16_field", "nibbles", "bit_planes", "shifts"]


def _reinterpret(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View the uint8 last axis of ``t`` as ``dtype``, copying only when a view is illegal."""
    size = torch.empty((), dtype=dtype).element_size()
    legal = (t.stride(-1) == 1 and t.storage_offset() % size == 0
             and all(s % size == 0 for s in t.stride()[:-1]))
    if not legal:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(dtype)


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block as float32, shape ``(n_blocks, 1)``."""
    return _reinterpret(blocks[:, offset:offset + 2], torch.float16).float()


def int32_words(field: torch.Tensor) -> torch.Tensor:
    """Little-endian 32-bit words of a uint8 field ``(..., 4k)`` as int32 ``(..., k)``.

    Values at or above 2**31 come out negative; callers shift and mask, which is exact.
    """
    return _reinterpret(field, torch.int32)


def u16_field(field: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 words of a uint8 field ``(..., 2k)`` as int32 ``(..., k)``."""
    return field[..., 0::2].to(torch.int32) | (field[..., 1::2].to(torch.int32) << 8)


@functools.lru_cache(maxsize=None)
def _shift_tensor(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).reshape(-1, 1)


def shifts(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Shift amounts as a ``(len(values), 1)`` column of ``like``'s dtype and device (cached)."""
    return _shift_tensor(values, like.dtype, like.device)


def nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q (..., g)`` uint8 → ``(..., 2, g)``: the low nibbles of the g bytes, then the high ones.

    This is ggml's order everywhere: in a group of g bytes, elements 0..g-1 are the low
    nibbles and elements g..2g-1 the high nibbles.
    """
    out = torch.empty((*q.shape[:-1], 2, q.shape[-1]), dtype=torch.uint8, device=q.device)
    torch.bitwise_and(q, 0x0F, out=out[..., 0, :])
    torch.bitwise_right_shift(q, 4, out=out[..., 1, :])
    return out


def bit_planes(q: torch.Tensor, values: tuple[int, ...], mask: int) -> torch.Tensor:
    """``q (..., g)`` → ``(..., len(values), g)``: ``(q >> s) & mask`` for each shift s in order."""
    return (q.unsqueeze(-2) >> shifts(values, q)) & mask
