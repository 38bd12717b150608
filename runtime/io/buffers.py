"""Host buffers for reads: page-aligned allocation, buffer views, pinned slabs under a budget.

O_DIRECT needs the buffer address, the file offset and the length on the alignment (4 KiB
here, the safe value for NVMe). ``torch.empty`` is not page-aligned; an anonymous ``mmap`` is,
and ``torch.frombuffer`` over it is zero-copy, so every buffer the engine allocates comes from
one. Pinning (``cudaHostRegister`` through torch) happens only when CUDA is present, only up to
the :class:`PinBudget`, and a failure falls back to pageable memory with a logged warning.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from typing import Any

import numpy as np
import torch

from expertfs.units import parse_size

from .errors import IOUsageError

__all__ = ["PAGE", "aligned_empty", "host_view", "is_device_buffer", "address_of", "nbytes_of",
           "PinBudget", "default_pin_budget", "HostSlab"]

log = logging.getLogger(__name__)

PAGE = 4096
HUGE_PAGE = 2 << 20


def aligned_empty(nbytes: int, *, alignment: int = PAGE, huge: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data starts on ``alignment`` (a power of two).

    Backed by an anonymous mapping (zero-filled, page-aligned); the tensor keeps it alive.
    ``huge``: a private mapping on a 2 MiB boundary, advised for transparent huge pages where
    the kernel offers them (``madvise`` mode): a slab the kernels stream every token then costs
    a TLB entry per 2 MiB instead of per 4 KiB (resident decode measured faster in an
    interleaved A/B; see bench/README.md); a plain shared mapping elsewhere.
    """
    if nbytes < 0 or alignment <= 0 or alignment & (alignment - 1):
        raise IOUsageError(f"aligned_empty({nbytes}, alignment={alignment}): size must be >= 0 and "
                           "alignment a power of two", fix="pass a valid size and alignment")
    huge = huge and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    if huge:
        alignment = max(alignment, HUGE_PAGE)
    extra = alignment if alignment > PAGE else 0
    try:
        if huge:
            mm = mmap.mmap(-1, nbytes + extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError as e:                 # a kernel without THP: small pages
                log.debug("no transparent huge pages for a %d-byte slab: %s", nbytes, e)
        else:
            mm = mmap.mmap(-1, max(nbytes + extra, PAGE))
    except OSError as e:
        raise IOUsageError(f"cannot allocate {nbytes >> 20} MiB of page-aligned memory: "
                           f"{e.strerror}", fix="give a smaller --ram / --vram budget") from None
    t = torch.frombuffer(mm, dtype=torch.uint8)
    skip = (-t.data_ptr()) % alignment
    return t[skip:skip + nbytes]


def is_device_buffer(buf: Any) -> bool:
    """True for CUDA tensors and objects exposing ``__cuda_array_interface__``."""
    if isinstance(buf, torch.Tensor):
        return buf.device.type != "cpu"
    return hasattr(buf, "__cuda_array_interface__")


def host_view(buf: Any) -> memoryview:
    """A writable, flat byte ``memoryview`` over a host buffer (zero-copy).

    Accepts contiguous CPU torch tensors, C-contiguous numpy arrays, bytearray, mmap and any
    writable buffer-protocol object.
    """
    if type(buf) is torch.Tensor and buf.dtype is torch.uint8 and buf.dim() == 1 \
            and buf.device.type == "cpu" and not buf.requires_grad and buf.is_contiguous():
        return memoryview(buf.numpy())             # the common case, fast
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise IOUsageError(f"a {buf.device} tensor is not host memory",
                               fix="read into a host buffer, or use a backend that writes to "
                                   "device memory (kvikio)")
        if not buf.is_contiguous():
            raise IOUsageError("the destination tensor is not contiguous",
                               fix="pass a contiguous tensor (see aligned_empty)")
        buf = buf.detach().numpy()
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous or not buf.flags.writeable:
            raise IOUsageError("the destination array is not C-contiguous and writable",
                               fix="pass np.ascontiguousarray(...) or an aligned_empty() buffer")
        buf = buf.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise IOUsageError(f"a {type(buf).__name__} is not a buffer",
                           fix="pass a torch tensor, numpy array, bytearray or mmap") from None
    if mv.readonly:
        raise IOUsageError("the destination buffer is read-only",
                           fix="pass a writable buffer (bytearray, aligned_empty())")
    if not mv.c_contiguous:
        raise IOUsageError("the destination buffer is not contiguous", fix="pass a contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def address_of(view: memoryview) -> int:
    """The address of a writable memoryview's first byte (0 for an empty view)."""
    if view.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def nbytes_of(buf: Any) -> int:
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    if hasattr(buf, "__cuda_array_interface__"):
        iface = buf.__cuda_array_interface__
        return int(np.prod(iface["shape"])) * np.dtype(iface["typestr"]).itemsize
    return memoryview(buf).nbytes


class PinBudget:
    """How many bytes may be page-locked, process-wide. Reservations never exceed ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.used = 0
        self._lock = threading.Lock()

    def try_reserve(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self.used = max(0, self.used - n)


_default_budget: PinBudget | None = None


def default_pin_budget() -> PinBudget:
    """``EXPERTFS_PIN_BUDGET`` (e.g. "8 GiB") or a quarter of physical RAM: an oversized pinned
    set starves the OS and the page cache, so the default is conservative."""
    global _default_budget
    if _default_budget is None:
        env = os.environ.get("EXPERTFS_PIN_BUDGET")
        if env:
            try:
                limit = parse_size(env)
            except ValueError as e:
                raise IOUsageError(f"EXPERTFS_PIN_BUDGET: {e}",
                                   fix="set it to a size such as 8G, or unset it") from None
        else:
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        _default_budget = PinBudget(limit)
    return _default_budget


def _cuda_host_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _cuda_host_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


class HostSlab:
    """``n_slots`` page-aligned slots of ``slot_bytes`` in one anonymous mapping.

    ``pin``: "auto" pins when CUDA is available, True asks for it (warns when impossible),
    False never pins. ``pinned`` says what happened and ``pin_note`` why.
    """

    def __init__(self, n_slots: int, slot_bytes: int, *, pin: bool | str = "auto",
                 budget: PinBudget | None = None, alignment: int = PAGE) -> None:
        if n_slots <= 0 or slot_bytes <= 0:
            raise IOUsageError(f"HostSlab({n_slots}, {slot_bytes}): both must be positive",
                               fix="size the slab from the extents it will hold")
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.stride = -(-slot_bytes // alignment) * alignment
        self.nbytes = self.stride * n_slots
        self.tensor = aligned_empty(self.nbytes, alignment=alignment, huge=True)
        self.pinned = False
        self.pin_note = "not pinned (pin=False)"
        self._budget = budget if budget is not None else default_pin_budget()
        if pin is True or pin == "auto":
            self._pin(required=pin is True)

    def _pin(self, *, required: bool) -> None:
        level = logging.WARNING if required else logging.DEBUG
        if not torch.cuda.is_available():
            self.pin_note = "not pinned: CUDA is not available"
            log.log(level, "host slab of %d bytes %s", self.nbytes, self.pin_note)
            return
        if not self._budget.try_reserve(self.nbytes):
            self.pin_note = (f"not pinned: {self.nbytes} bytes would exceed the pin budget "
                             f"({self._budget.used} of {self._budget.limit} bytes in use; "
                             "raise EXPERTFS_PIN_BUDGET or use fewer slots)")
            log.warning("host slab %s", self.pin_note)
            return
        try:
            err = _cuda_host_register(self.tensor.data_ptr(), self.nbytes)
        except (RuntimeError, AttributeError) as e:
            err, detail = -1, str(e)
        else:
            detail = f"cudaHostRegister returned {err}"
        if err != 0:
            self._budget.release(self.nbytes)
            self.pin_note = f"not pinned: {detail}; using pageable memory (slower uploads)"
            log.warning("host slab of %d bytes %s", self.nbytes, self.pin_note)
            return
        self.pinned = True
        self.pin_note = "pinned with cudaHostRegister"

    def slot(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n_slots:
            raise IOUsageError(f"slot {i} is outside the slab's {self.n_slots} slots",
                               fix="index slots from 0 to n_slots - 1")
        return self.tensor[i * self.stride:i * self.stride + self.slot_bytes]

    def close(self) -> None:
        if self.pinned:
            _cuda_host_unregister(self.tensor.data_ptr())
            self._budget.release(self.nbytes)
            self.pinned = False

    def __enter__(self) -> HostSlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
