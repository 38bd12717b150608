"""Experts as the forward pass sees them: quantized weights made resident on request.

``protocol`` defines what the MoE layer asks for (``ExpertProvider``) and what it gets
(``ExpertWeights`` of ``QWeight`` views); providers implement it (``direct``: a plain read per
request, the reference; the tiered one is ``expertfs.runtime.cache.provider``).
"""

from .protocol import ExpertProvider, ExpertWeights, ProviderStats, QWeight, weights_from_buffer

__all__ = ["ExpertProvider", "ExpertWeights", "ProviderStats", "QWeight", "weights_from_buffer"]
