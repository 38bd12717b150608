"""Expert parts as the providers hand them over, from valid random ggml blocks: a quantized
matrix and an F32 bias (gpt-oss's bias rows), for the tests of the expert products."""

from __future__ import annotations

import numpy as np
import torch

from expertfs.formats.ggml import GGMLType, block_size
from expertfs.formats.random_blocks import make_blocks
from expertfs.runtime.experts.protocol import QWeight


def qweight(t: GGMLType, rows: int, cols: int, seed: int) -> QWeight:
    """A ``rows x cols`` matrix of type ``t``: blocks scaled as a layer's weights are."""
    b = make_blocks(t, rows * cols // block_size(t), cols ** -0.5, np.random.default_rng(seed))
    return QWeight(torch.from_numpy(np.ascontiguousarray(b).reshape(-1).copy()), t, (rows, cols))


def f32_bias(n: int, seed: int) -> QWeight:
    """An F32 bias part of ``n`` values."""
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.1
    return QWeight(v.view(torch.uint8), GGMLType.F32, (n,))
