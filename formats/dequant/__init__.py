"""Torch dequantisation kernels for the ggml types found in MoE GGUFs.

``dequantize(raw, ggml_type, shape, dtype)`` turns the ggml bytes of a tensor into a float
tensor on the same device; ``linear(x, raw, ggml_type, shape)`` computes ``F.linear(x, W)``
from the bytes without materialising all of W at once. Pure torch ops (no numpy, no Python
loop over blocks): one code path for CPU and CUDA. Results equal gguf-py's numpy
``gguf.quants.dequantize`` bit for bit for every supported type.

Modules, one concept each: ``fields`` (reading block fields), ``tables`` (IQ grids and value
tables from gguf-py, cached per device), ``simple`` (F32/F16/BF16), ``legacy`` (Q4_0 ... Q8_0),
``kquants`` (Q2_K ... Q6_K), ``iq_grid`` (IQ1/IQ2/IQ3), ``iq4`` (IQ4_NL/IQ4_XS), ``mxfp4``,
``ternary`` (TQ1_0/TQ2_0), ``dispatch`` (the type table, checks, ``dequantize``) and ``fused``
(``linear``).
"""

from .dispatch import KERNELS, SUPPORTED_TYPES, dequantize, dequantize_blocks
from .errors import QuantShapeError, UnsupportedQuantError
from .fused import linear

__all__ = ["dequantize", "dequantize_blocks", "linear", "KERNELS", "SUPPORTED_TYPES",
           "QuantShapeError", "UnsupportedQuantError"]
