"""Per-thread float32 scratch buffers for a prompt's large temporaries, reused call after call.

A fresh tensor of tens of MB can be fresh pages from the kernel: glibc maps a block past its
mmap threshold (at most 32 MiB, ``runtime.heap``) on its own, unless the heap has a free chunk
that large, and unmaps it on free, so each use faults in and zeroes its pages again before the
computation writes them (on a virtual machine's first touch, more than the computation itself:
bench/README.md). A named buffer
here is allocated once per thread, grown when a larger call needs it, never shrunk, and handed
out as a view: what was written there is gone at the next call for the same name, so a caller
uses it only until it returns (a layer's temporaries, not a result that outlives the call).
Different names never share memory, so two temporaries alive at once take two names.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["buffer"]

_local = threading.local()


def buffer(name: str, n: int) -> torch.Tensor:
    """This thread's float32 CPU buffer ``name``, at least ``n`` elements; its first ``n``."""
    bufs: dict[str, torch.Tensor] | None = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.numel() < n:
        buf = bufs[name] = torch.empty(n, dtype=torch.float32)
    return buf[:n]
