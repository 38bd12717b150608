"""Copies between the tiers: a dedicated CUDA copy stream with events, or plain copies on CPU.

A *fence* is what later work must wait for before it touches a buffer: a ``torch.cuda.Event``
recorded after an asynchronous copy (or after the compute stream's use of a slot), or ``None``
when nothing is pending (every CPU copy is synchronous, so on CPU fences are always ``None``).

* ``copy(dst, src, after=..., then=...)`` queues ``dst.copy_(src)`` on the copy stream after the
  given fences, runs ``then()`` on the copy stream (slot-table updates), and returns the fence
  of all that. The host never waits.
* ``compute_wait(fence)`` makes the compute stream (the current stream) wait on the GPU, not on
  the host; ``compute_mark()`` records where the compute stream is (a layer's release), so a copy
  into a slot the layer read can be ordered after it.
* ``host_wait(fence)`` blocks the host: only before a host-side writer (a storage read) reuses a
  host slot an asynchronous copy may still be reading.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from typing import Any

import torch

from expertfs.errors import UsageError

__all__ = ["Copier", "Fence", "cpu_copy", "fence_done", "host_wait"]

Fence = Any          # torch.cuda.Event, or None once nothing is pending


def cpu_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A host-to-host copy in the calling thread: one ``memmove`` for contiguous byte tensors.
    (``Tensor.copy_`` runs on torch's intra-op thread pool; while I/O threads keep the cores
    busy, its parallel region waited milliseconds for a descheduled helper on 2 cores.)"""
    n = dst.numel() * dst.element_size()
    if (dst.device.type == src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous()
            and dst.dtype == src.dtype and dst.numel() == src.numel()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)


def fence_done(fence: Fence) -> bool:
    """True when nothing waits behind ``fence`` any more (a CUDA event query; no sync)."""
    return fence is None or bool(fence.query())


def host_wait(fence: Fence) -> None:
    """Block the calling thread until ``fence`` has passed."""
    if fence is not None:
        fence.synchronize()


class Copier:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise UsageError(f"device {device} asked for but CUDA is not available",
                               fix="use device='cpu', or install a CUDA build of torch")
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Iterable[Fence] = (),
             then: Callable[[], None] | None = None) -> Fence:
        """``dst.copy_(src)`` ordered after ``after``; ``then()`` runs after it on the same
        stream. Returns the fence of the copy and ``then`` (None on CPU: already done)."""
        if not self.cuda:
            cpu_copy(dst, src)
            if then is not None:
                then()
            return None
        s = self.stream
        with torch.cuda.stream(s):
            for f in after:
                if f is not None:
                    s.wait_event(f)
            dst.copy_(src, non_blocking=True)
            if then is not None:
                then()
            ev = torch.cuda.Event()
            ev.record(s)
        return ev

    def copy_slots(self, dst: Any, d: int, src: Any, s: int, n: int, *,
                   after: Iterable[Fence] = (), then: Callable[[], None] | None = None) -> Fence:
        """``n`` bytes from slot ``s`` of pool ``src`` to slot ``d`` of pool ``dst`` (see
        ``copy``). Host to host is one ``memmove`` by address: no tensor is made or freed."""
        if not self.cuda:
            ctypes.memmove(dst.address(d), src.address(s), n)
            if then is not None:
                then()
            return None
        return self.copy(dst.view(d)[:n], src.view(s)[:n], after=after, then=then)

    def transient(self, src: torch.Tensor, *, after: Iterable[Fence] = ()) -> tuple[torch.Tensor, Fence]:
        """A fresh device copy of host ``src`` (no device tier): allocated on the copy stream
        and marked as used by the compute stream, so the allocator cannot hand its memory out
        again before the compute stream is done with it."""
        if not self.cuda:
            return src, None
        s = self.stream
        with torch.cuda.stream(s):
            for f in after:
                if f is not None:
                    s.wait_event(f)
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s)
        dst.record_stream(torch.cuda.current_stream(self.device))
        return dst, ev

    def on_stream(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (small device writes) on the copy stream, in order with the copies."""
        if not self.cuda:
            fn()
            return
        with torch.cuda.stream(self.stream):
            fn()

    def compute_wait(self, fence: Fence) -> None:
        if fence is not None:
            torch.cuda.current_stream(self.device).wait_event(fence)

    def compute_mark(self) -> Fence:
        """A fence after everything queued so far on the compute (current) stream."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()
