"""Tensor bytes of a synthetic model, generated chunk by chunk from the seed.

Memory stays flat in model size: a tensor is produced in chunks of ``CHUNK_BYTES``. Chunk ``k``
of a tensor draws from its own generator, seeded by ``(seed, hash(tensor name), k)``, so the
bytes of a tensor do not depend on which other tensors the model has (a 4-layer and a 40-layer
file share their first layers' bytes).

Small tensors are made directly (``formats.random_blocks.make_blocks``). Large tensors of a
natively quantized type are tiled from a pool of ``POOL_BYTES`` of blocks quantized by gguf-py
from Gaussian weights (quantizing in numpy is far slower than gathering); each chunk picks its
blocks from the pool at random, so every expert gets distinct bytes. Large K/IQ tensors are
synthesized directly, which needs no quantizer and is fast enough as it is.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterator

import numpy as np

from ..formats.ggml import GGMLType, block_size, type_size
from ..formats.random_blocks import NATIVE_TYPES, make_blocks, native_blocks
from .archs import Init, TensorPlan

__all__ = ["TensorData", "CHUNK_BYTES", "POOL_MIN_BYTES", "POOL_BYTES"]

CHUNK_BYTES = 8 << 20
POOL_MIN_BYTES = 4 << 20
POOL_BYTES = 2 << 20         # per (type, sigma): 62k Q8_0 blocks, 2k rows of 256 F32
_FLOAT_UNIT = 256            # elements per pool "block" for F32/F16/BF16


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _rng(*entropy: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(entropy))))


class TensorData:
    """Chunk source for ``write_gguf``: ``chunks(plan, ggml_type)`` yields the tensor's bytes."""

    def __init__(self, seed: int, pool_min_bytes: int | None = None) -> None:
        self.seed = int(seed)
        self.pool_min_bytes = POOL_MIN_BYTES if pool_min_bytes is None else pool_min_bytes
        self._pools: dict[tuple[GGMLType, int, float], np.ndarray] = {}

    def chunks(self, plan: TensorPlan, t: GGMLType) -> Iterator[np.ndarray]:
        key = _name_key(plan.name)
        if plan.init is not Init.W:
            yield self._small_f32(plan, key)
            return
        n = plan.n_elements
        unit = block_size(t) if t not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16) \
            else math.gcd(n, _FLOAT_UNIT)
        per_unit = type_size(t) * unit // block_size(t)
        n_units = n // unit
        if n_units * per_unit < self.pool_min_bytes:
            yield make_blocks(t, n // block_size(t), plan.sigma, _rng(self.seed, key, 0))
            return
        per_chunk = max(1, CHUNK_BYTES // per_unit)
        pool = self._pool(t, unit, plan.sigma) if t in NATIVE_TYPES else None
        for k, start in enumerate(range(0, n_units, per_chunk)):
            rng = _rng(self.seed, key, k)
            count = min(per_chunk, n_units - start)
            if pool is None:
                yield make_blocks(t, count, plan.sigma, rng)
            else:
                yield pool.take(rng.integers(0, len(pool), count), axis=0)

    def _small_f32(self, plan: TensorPlan, key: int) -> np.ndarray:
        rng = _rng(self.seed, key, 0)
        if plan.init is Init.DECAY:
            a_log = rng.uniform(0.0, np.log(16.0), plan.n_elements)
            return (-np.exp(a_log)).astype(np.float32)
        w = rng.standard_normal(plan.n_elements, dtype=np.float32) * np.float32(plan.sigma)
        if plan.init is Init.NORM:
            w += np.float32(1.0)
        return w

    def _pool(self, t: GGMLType, unit: int, sigma: float) -> np.ndarray:
        k = (t, unit, float(np.float32(sigma)))
        pool = self._pools.get(k)
        if pool is None:
            sigma_bits = int(np.float32(sigma).view(np.uint32))
            rng = _rng(self.seed, 0x706F6F6C, int(t), sigma_bits)
            per_unit = unit // block_size(t)
            n = max(1024, POOL_BYTES // (per_unit * type_size(t)))
            pool = native_blocks(t, n * per_unit, sigma, rng).reshape(n, per_unit * type_size(t))
            self._pools[k] = pool
        return pool
