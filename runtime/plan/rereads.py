"""What a trunk the cap keeps partly out of memory costs ``expertfs plan``: the bytes read again
from the drive, a prompt batch (the page cache's LRU) and a decode token (the LRU, or what
``run`` streams instead where that reads less: ``runtime.model.trunk_stream``)."""

from __future__ import annotations

from ..memory import trunk_stream_share
from .assumptions import PAGE_REREAD, TRUNK_REREAD
from .budget import Memory
from .geometry import Geometry
from .rates import Range

__all__ = ["trunk_reads", "trunk_reread_bytes"]


def trunk_reread_bytes(mem: Memory, g: Geometry | None = None) -> tuple[int, int]:
    """Bytes of an evicted trunk re-read by a pass over it, a prompt batch or (``g`` given) a
    decode token (slow, fast end): ``TRUNK_REREAD`` times the evicted bytes (``plan.assumptions``)
    at most all, a token's slow end at most what ``run`` streams instead (``runtime.model.
    trunk_stream``: it does where the page cache re-reads more); with the runtime's library
    pages out of memory too, ``PAGE_REREAD`` times those."""
    whole = mem.ram.item("trunk")
    fast, slow = (min(whole, int(m * mem.trunk_evicted)) for m in TRUNK_REREAD)
    if g is not None and mem.trunk_evicted:
        units = g.trunk_units()
        streamed = int(sum(units) * trunk_stream_share(units, mem.trunk_evicted))
        slow = max(fast, min(slow, streamed))
    pf, ps = (int(m * mem.pages_evicted) for m in PAGE_REREAD)
    return slow + ps, fast + pf


def trunk_reads(mem: Memory, storage: Range, g: Geometry) -> tuple[float, float, str]:
    """Seconds a token re-reading an evicted trunk (slow, fast end), and what it reads."""
    slow, fast = trunk_reread_bytes(mem, g)
    return (slow / (storage.slow * 1e9), fast / (storage.fast * 1e9),
            f"{fast / 2**20:.0f}-{slow / 2**20:.0f} MiB re-read per token "
            f"({mem.trunk_evicted / 2**20:.0f} MiB of the trunk out of memory"
            + (f", and {mem.pages_evicted / 2**20:.0f} MiB of the runtime's pages"
               if mem.pages_evicted else "") + ")")
