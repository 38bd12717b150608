"""Experts as the forward pass sees them: quantized weights made resident on request.

``protocol`` defines what the MoE layer asks for (``ExpertProvider``) and what it gets
(``ExpertWeights`` of ``QWeight`` views); providers implement it (``direct``: a plain read per
request, the reference; the tiered one is ``expertfs.runtime.cache.provider``), and the optional
capabilities a provider declares by subclassing them (``SplitGet``, ``BoundedGet``,
``WarmStart``, ``TierState``, ``PrefetchReport``).
"""

from .protocol import (BoundedGet, ExpertProvider, ExpertWeights, PrefetchReport, ProviderStats,
                       QWeight, SplitGet, TierState, WarmStart, weights_from_buffer)

__all__ = ["ExpertProvider", "ExpertWeights", "ProviderStats", "QWeight", "weights_from_buffer",
           "SplitGet", "BoundedGet", "WarmStart", "TierState", "PrefetchReport"]
