"""Cache policies (pure: no I/O, no wall clock): which resident experts to keep.

``base`` (the protocol, LRU, decayed LFU), ``window`` (window LFU, the default), ``arc``,
``layer`` (per-layer quotas), ``registry`` (policies by name for the CLI and benchmarks).
"""
