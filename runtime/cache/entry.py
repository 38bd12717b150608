"""Residency of one expert: its state, where its bytes are, and what is still in flight.

::

    ABSENT ──read issued──▶ LOADING ──future done──▶ HOST ──upload queued──▶ UPLOADING ──event──▶ DEVICE
                                                       ▲                                            │
                                                       └──────────── demoted (device → host) ◀──────┘

Tiers are exclusive (as the simulator's default): an expert is in the host tier or in the device
tier, never both. ``LOADING`` is driven by a read future (the I/O engine's), ``UPLOADING`` by a
CUDA event (the copy stream's); on CPU uploads are synchronous and go straight to ``DEVICE``.
A demand read for a miss lands in a *staging* host slot that is not part of the host tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from expertfs.store.layout import Extent

from ..experts.protocol import ExpertWeights, ProviderStats

__all__ = ["State", "Entry", "TieredStats", "landed"]


class State(IntEnum):
    ABSENT = 0
    LOADING = 1
    HOST = 2
    UPLOADING = 3
    DEVICE = 4


@dataclass(eq=False, slots=True)
class Entry:
    key: int
    layer: int
    expert: int
    extent: Extent
    state: State = State.ABSENT
    host_slot: int = -1
    dev_slot: int = -1
    future: Any = None                 # the read while LOADING (None: a dripped read not issued)
    fence: Any = None                  # the upload while UPLOADING
    staging: bool = False              # a demand read in a staging slot (not in the host tier)
    lent: bool = False                 # read into the prompt window's spare slot (``window``)
    dripped: bool = False              # read through the loader's drip (warm start, prefetch)
    source: str | None = None          # the prefetch source that fetched it, until first use
    target: tuple[int, int] | None = None   # prefetch: (target layer index, cursor at issue)
    staged_at: int = -1                # staged prefetch: the acquire count when it was issued
    weights: ExpertWeights | None = None    # cached views into the slot the compute tier reads
    transient: Any = None              # a device copy for one get (CUDA, no device tier)

    @property
    def nbytes(self) -> int:
        return self.extent.length


def landed(e: Entry) -> bool:
    """The bytes of ``e`` are in its host slot, or its read ended (a failure included): waiting
    for it would not block."""
    return e.state is not State.LOADING or (e.future is not None and e.future.done())


@dataclass
class TieredStats(ProviderStats):
    """``ProviderStats`` plus what the tiered mechanism moves (tiers are ``vram`` and ``ram``)."""

    joined: int = 0                    # demands that joined an in-flight prefetch or warm read
    prefetch_cancelled: int = 0        # prefetches dropped before their read started
    prefetch_refused: int = 0          # not issued: no slot to spare or in-flight bound reached
    evictions: dict[str, int] = field(default_factory=dict)
    uploads: int = 0                   # host → device copies
    demotions: int = 0                 # device → host copies (exclusive tiers)
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    warm_issued: int = 0
    warm_bytes: int = 0
    read_errors: int = 0               # failed prefetch / warm reads (dropped; demand retries)

    @property
    def hit_rate(self) -> float:
        return sum(self.hits.values()) / self.requests if self.requests else 0.0
