"""Reading the fields of ggml blocks out of a ``(n_blocks, type_size)`` uint8 tensor.

Every kernel receives its blocks as one 2-D uint8 tensor, one block per row, and slices the
fields of the block layout (``ggml-common.h``) out of it with these helpers. They are pure torch
and device-agnostic; ggml data is little-endian, as is every host torch runs on.

Speed notes (CPU, measured; figures in bench/README.md): torch's vectorized loops skip rows
shorter than one vector (32 bytes on AVX2), so a narrow strided field is several times slower
to operate on than a contiguous copy of it; tensor-by-tensor broadcast shifts run a scalar loop;
a byte transpose is slow. The helpers below avoid all three.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["reinterpret", "f16_field", "int32_words", "u16_field", "nibbles", "bit_planes",
           "bits_per_byte", "word_fields"]


def reinterpret(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View the uint8 last axis of ``t`` as ``dtype``, copying only when a view is illegal."""
    size = torch.empty((), dtype=dtype).element_size()
    legal = (t.stride(-1) == 1 and t.storage_offset() % size == 0
             and all(s % size == 0 for s in t.stride()[:-1]))
    if not legal:
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(dtype)


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block as float32, shape ``(n_blocks, 1)``."""
    return reinterpret(blocks[:, offset:offset + 2], torch.float16).float()


def int32_words(field: torch.Tensor) -> torch.Tensor:
    """Little-endian 32-bit words of a uint8 field ``(..., 4k)`` as int32 ``(..., k)``.

    Values at or above 2**31 come out negative; callers shift and mask, which is exact.
    """
    return reinterpret(field, torch.int32)


def u16_field(field: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 words of a uint8 field ``(..., 2k)`` as int32 ``(..., k)``."""
    return field[..., 0::2].to(torch.int32) | (field[..., 1::2].to(torch.int32) << 8)


def nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q (..., g)`` uint8 → ``(..., 2, g)``: the low nibbles of the g bytes, then the high ones.

    This is ggml's order everywhere: in a group of g bytes, elements 0..g-1 are the low
    nibbles and elements g..2g-1 the high nibbles. ``q`` is made contiguous first: torch's
    vectorized loops skip rows shorter than a vector (32 bytes on AVX2), and a strided
    (..., 16) field is several times slower to operate on than one contiguous copy of it.
    """
    q = q.contiguous()
    return torch.stack((q & 0x0F, q >> 4), dim=-2)


def bit_planes(q: torch.Tensor, values: tuple[int, ...], mask: int) -> torch.Tensor:
    """``q (..., g)`` → ``(..., len(values), g)``: ``(q >> s) & mask`` for each shift s in order.

    One scalar shift per plane: torch's tensor-by-tensor broadcast shift is a scalar loop on
    CPU (measured far slower than these stacked scalar-shift ops).
    """
    q = q.contiguous()
    return torch.stack([(q >> s) & mask if s else q & mask for s in values], dim=-2)


@functools.lru_cache(maxsize=None)
def _byte_lut(values: tuple[int, ...], mask: int, device: torch.device) -> torch.Tensor:
    b = torch.arange(256, dtype=torch.int32).reshape(-1, 1)
    return ((b >> torch.tensor(values, dtype=torch.int32)) & mask).to(torch.uint8).to(device)


def bits_per_byte(q: torch.Tensor, values: tuple[int, ...], mask: int) -> torch.Tensor:
    """``q (n, w)`` uint8 → ``(n, w * len(values))`` uint8 in byte-major order: byte i's fields
    ``(q[:, i] >> s) & mask`` for s in ``values``, then byte i + 1's.

    One row gather from a cached 256-row table: a narrow field like Q5_0's 4 ``qh`` bytes
    would otherwise be a row loop of 4 elements per op or a byte transpose (both measured
    several times slower on CPU).
    """
    n, w = q.shape
    lut = _byte_lut(tuple(values), mask, q.device)
    rows = torch.index_select(lut, 0, q.reshape(-1).to(torch.int32))
    return rows.reshape(n, w * len(values))


def word_fields(words: torch.Tensor, values: tuple[int, ...], mask: int) -> torch.Tensor:
    """int32 ``words (n, k)`` → ``(n, k * len(values))`` word-major: word i's fields
    ``(words[:, i] >> s) & mask`` for s in ``values``, then word i + 1's.

    For the few scale/sign words of a super-block (k·len ≤ 32 per 256 weights), so the
    stacked copy is small.
    """
    n, k = words.shape
    words = words.contiguous()
    planes = [(words >> s) & mask if s else words & mask for s in values]
    return torch.stack(planes, dim=-1).reshape(n, k * len(values))
