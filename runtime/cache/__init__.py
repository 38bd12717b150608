"""The cache mechanism: expert slots in RAM and VRAM, residency, and the moves between tiers.

What to keep is decided by the pure policies (``expertfs.runtime.policies``); this package
only executes it, with real buffers, reads and copies:

* ``slots``: fixed-size slots carved from one slab per tier (host slab page-aligned and pinned
  when CUDA is present, within the pin budget; device slab in VRAM, or on CPU);
* ``table``: the (layer, expert) → slot table on the compute device, mirrored on the host;
* ``entry``: residency states (absent → loading → host → uploading → device) and stats;
* ``copier``: the copy stream, events and the compute stream's waits;
* ``loader``: reads through the I/O engine, completion without a thread, warm-start drip;
* ``sizing``: slot geometry from a store and budgets as slots;
* ``residency``, ``staged``, ``device``: entries, pins and reads; staged prefetches; the VRAM tier;
* ``tiers``: ``TierCache``, the mechanism composing them (the replay simulator's semantics, call
  for call);
* ``usage``: learned usage counts, persisted in the store and read back for warm starts.

``expertfs.runtime.cache.provider.TieredProvider`` puts it behind the ``ExpertProvider`` protocol.
"""

from .copier import Copier, cpu_copy, fence_done, host_wait
from .entry import Entry, State, TieredStats
from .loader import Loader
from .sizing import SlotGeometry, Slots, plan_slots
from .slots import SlotPool
from .table import SlotTable
from .residency import NullListener, Residency
from .staged import StagedPrefetch
from .device import DeviceTier
from .tiers import TierCache
from .usage import UsageRecorder, load_rates, persist_usage

__all__ = ["Copier", "cpu_copy", "fence_done", "host_wait", "Entry", "State", "TieredStats", "Loader",
           "SlotGeometry", "Slots", "plan_slots", "SlotPool", "SlotTable", "NullListener", "Residency",
           "StagedPrefetch", "DeviceTier", "TierCache", "UsageRecorder", "load_rates", "persist_usage"]
