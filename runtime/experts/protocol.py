"""The contract between the MoE layer and whatever keeps experts resident.

The MoE layer routes, then calls ``provider.get(layer, ids)``: the provider makes those experts
resident on the compute device (demand reads outrank prefetches) and returns ``ExpertWeights``
whose ``QWeight`` views stay valid, and are never evicted, until ``provider.release(layer)``.
``prefetch`` is a non-blocking hint; a provider may ignore it. Weights are the store's bytes,
unchanged: ``QWeight.raw`` is a uint8 tensor of ``rows × row_bytes`` and ``shape`` is the
torch (out, in) shape, so ``expertfs.formats.dequant.linear(x, w.raw, w.ggml_type, w.shape)``
computes ``x @ W.T`` like ``nn.Linear``.

Beyond that contract a provider may offer optional capabilities, each a small runtime-checkable
protocol below that the provider declares by subclassing it (and implementing it). Callers test
for one with ``isinstance`` (once, where they set up) instead of probing attribute names:

``SplitGet``        ``get_begin``: the resident experts now, the rest when read (overlap)
``BoundedGet``      ``max_experts_per_get``: how many experts one ``get`` may ask for now
``WarmStart``       ``hold_warm``/``resume_warm``: a background warm start that can wait
``TierState``       ``is_resident``/``prefetch_in_flight``: what a tier holds or is reading
``PrefetchReport``  ``prefetch_report``: per prefetch source, what its prefetches became
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from expertfs.formats.ggml import GGMLType
from expertfs.formats.moe_names import Role
from expertfs.store.layout import Extent

__all__ = ["QWeight", "ExpertWeights", "ExpertProvider", "ProviderStats", "weights_from_buffer",
           "SplitGet", "BoundedGet", "WarmStart", "TierState", "PrefetchReport"]


@dataclass(frozen=True)
class QWeight:
    raw: torch.Tensor            # uint8, the part's bytes, on the compute device
    ggml_type: GGMLType
    shape: tuple[int, ...]       # torch order: (out, in) for matrices, (n,) for biases


@dataclass(frozen=True)
class ExpertWeights:
    layer: int
    expert: int
    parts: Mapping[Role, QWeight]

    def get(self, role: Role) -> QWeight | None:
        return self.parts.get(role)


@dataclass
class ProviderStats:
    """Counters every provider keeps; the runtime prints them and writes them to --json."""

    requests: int = 0            # experts asked for by get()
    hits: dict[str, int] = field(default_factory=dict)   # per tier name: already resident
    misses: int = 0              # demand reads from storage
    bytes_read: int = 0          # from storage, demand and prefetch
    prefetch_issued: int = 0
    prefetch_used: int = 0       # prefetched experts later asked for by get()
    prefetch_wasted: int = 0     # prefetched experts evicted or dropped unused
    late_bytes: int = 0          # bytes of prefetches still in flight when get() needed them
    stall_seconds: float = 0.0   # time get() spent waiting on storage

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@runtime_checkable
class ExpertProvider(Protocol):
    stats: ProviderStats

    def get(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        """Make ``experts`` of ``layer`` resident and return their weights (blocking)."""

    def release(self, layer: int) -> None:
        """The running layer is done with what ``get`` returned; those may now be evicted."""

    def prefetch(self, layer: int, experts: Sequence[int], source: str = "gate") -> None:
        """Hint: these will probably be needed soon (never blocks); ``source`` names the
        predictor, for providers that score predictions per source."""

    def close(self) -> None:
        ...


# --- optional capabilities ---------------------------------------------------------------------

@runtime_checkable
class SplitGet(Protocol):
    def get_begin(self, layer: int, experts: Sequence[int]
                  ) -> tuple[dict[int, ExpertWeights], Callable[..., dict[int, ExpertWeights]]]:
        """``get`` in two halves: (weights of the experts resident now, ``finish(only=None)``
        that waits for the others, or only for those of ``only``, and returns theirs);
        ``release(layer)`` as after ``get``."""


@runtime_checkable
class BoundedGet(Protocol):
    @property
    def max_experts_per_get(self) -> int:
        """How many experts one ``get`` may ask for now (0: no limit); the MoE layer splits
        wider requests into parts, releasing each before the next."""


@runtime_checkable
class WarmStart(Protocol):
    def hold_warm(self) -> None:
        """Issue no more warm-start reads until ``resume_warm``."""

    def resume_warm(self) -> None:
        ...


@runtime_checkable
class TierState(Protocol):
    def is_resident(self, layer: int, expert: int) -> bool:
        """The expert is in a tier or being read into one (a routed layer's expert only)."""

    def prefetch_in_flight(self) -> int:
        """Prefetch reads issued and not yet landed."""


@runtime_checkable
class PrefetchReport(Protocol):
    def prefetch_report(self) -> dict[str, dict[str, Any]]:
        """Per prefetch source (``prefetch(..., source=)``): what its prefetches became."""


def weights_from_buffer(extent: Extent, buf: torch.Tensor) -> ExpertWeights:
    """Views of every part of ``extent`` inside ``buf`` (a uint8 tensor holding the extent)."""
    flat = buf.reshape(-1)
    parts = {}
    for p in extent.parts:
        shape = tuple(reversed(p.ne))
        parts[p.role] = QWeight(flat[p.rel_offset:p.rel_offset + p.nbytes], p.ggml_type, shape)
    return ExpertWeights(extent.layer, extent.expert, parts)
