"""Host buffers for reads: page-aligned allocation, buffer views, pinned slabs under a budget.

O_DIRECT needs the buffer address, the file offset and the length on the alignment (4 KiB
here, the safe value for NVMe). ``torch.empty`` is not page-aligned; an anonymous ``mmap`` is,
and ``torch.frombuffer`` over it is zero-copy, so every buffer the engine allocates comes from
one. Pinning (``cudaHostRegister`` through torch) happens only when CUDA is present, as far as
the :class:`PinBudget` goes (a slab larger than what is left is pinned in part, slot by slot), and
a failure is cleared from the CUDA runtime and falls back to pageable memory with a
:class:`PinWarning`.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import warnings
from typing import Any

import numpy as np
import torch

from expertfs.units import parse_size

from .errors import IOUsageError
from .pages import HUGE_PAGE, MADV_POPULATE_READ, MADV_POPULATE_WRITE, huge_pages_pay, libc

__all__ = ["PAGE", "aligned_empty", "host_view", "is_device_buffer", "address_of", "nbytes_of",
           "PinBudget", "PinWarning", "default_pin_budget", "HostSlab", "Prefault", "libc",
           "MADV_POPULATE_READ", "MADV_POPULATE_WRITE"]

log = logging.getLogger(__name__)

PAGE = 4096


def aligned_empty(nbytes: int, *, alignment: int = PAGE, slab: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data starts on ``alignment`` (a power of two).

    Backed by an anonymous mapping (zero-filled, page-aligned); the tensor keeps it alive.
    ``slab`` (a large buffer the kernels stream or reads fill): a private mapping, on a 2 MiB
    boundary and advised for transparent huge pages where the kernel offers them (``madvise``
    mode) and they pay on this box (``pages.huge_pages_pay``: not in a one-shot process whose
    kernel hands free pages back to a hypervisor), else advised against them: a slab the
    kernels stream every token then costs a TLB entry per 2 MiB instead of per 4 KiB, and a
    read into it a segment per 2 MiB; a plain shared mapping elsewhere.
    """
    if nbytes < 0 or alignment <= 0 or alignment & (alignment - 1):
        raise IOUsageError(f"aligned_empty({nbytes}, alignment={alignment}): size must be >= 0 and "
                           "alignment a power of two", fix="pass a valid size and alignment")
    private = slab and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
    huge = private and huge_pages_pay()
    if huge:
        alignment = max(alignment, HUGE_PAGE)
    extra = alignment if alignment > PAGE else 0
    try:
        if private:
            mm = mmap.mmap(-1, nbytes + extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
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

    def reserve_up_to(self, n: int, unit: int) -> int:
        """Reserve as much of ``n`` bytes as fits, in whole ``unit``s; returns the bytes taken."""
        with self._lock:
            take = min(n, max(0, self.limit - self.used) // unit * unit)
            self.used += take
            return take

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


class PinWarning(RuntimeWarning):
    """Host memory could not be page-locked (or unlocked): what failed, the CUDA error, and the
    consequence (pageable memory: host-to-device copies of it are synchronous)."""


def _cuda_host_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _cuda_host_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


_cudart_lib: Any = None


def _cuda_get_last_error() -> int:
    """``cudaGetLastError()``: returns and clears the runtime's pending error (torch's cudart
    bindings lack it, so it is called from the libcudart torch loaded; -1 if none is found).
    A failed ``cudaHostRegister`` leaves its error pending: the next kernel launch check of
    unrelated work would raise it."""
    global _cudart_lib
    if _cudart_lib is None:
        import glob
        names = [None, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]
        names += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia",
                                               "cuda_runtime", "lib", "libcudart.so*")))
        for name in names:
            try:
                lib = ctypes.CDLL(name)
                fn = lib.cudaGetLastError
            except (OSError, AttributeError):
                continue
            fn.restype = ctypes.c_int
            _cudart_lib = fn
            break
        else:
            _cudart_lib = False
    return int(_cudart_lib()) if _cudart_lib else -1


def _cuda_error_name(err: int) -> str:
    try:
        return f"{err} ({torch.cuda.cudart().cudaGetErrorString(err)})"
    except Exception:                       # noqa: BLE001 - the name is only for the message
        return str(err)


class Prefault:
    """Faults the pages of a host tensor in from a background thread at the lowest CPU
    priority, a bounded chunk at a time (``madvise(MADV_POPULATE_WRITE)``: the kernel's zeroing
    of each new page, with nothing written over what is already there).

    A fresh slab's pages are otherwise faulted in by the first read into each one, inside the
    read's system call, on the cores the prompt is computing on (the kernel zeroing each new
    page: seconds of CPU for a tier of a few GB on a virtual machine, bench/README.md). At
    nice 19 this thread only takes CPU time nobody else wants (startup, reads in flight), and
    a page a read reaches first is simply skipped. ``stop()`` ends it after the chunk in hand; on a kernel without
    the advice it stops at once and the reads fault the pages in as before.
    """

    CHUNK = 32 << 20

    def __init__(self, t: torch.Tensor) -> None:
        self._stop = threading.Event()
        self.done = 0                                # bytes populated so far
        self._thread = threading.Thread(target=self._run, args=(t,), daemon=True,
                                        name="expertfs-prefault")
        self._thread.start()

    def _run(self, t: torch.Tensor) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)   # this thread
        except (OSError, AttributeError):
            pass
        lib = libc()
        if lib is None:
            return
        madvise = lib.madvise
        start = t.data_ptr() // PAGE * PAGE
        end = t.data_ptr() + t.numel() * t.element_size()
        for a in range(start, end, self.CHUNK):
            if self._stop.is_set():
                return
            if madvise(a, min(self.CHUNK, end - a), MADV_POPULATE_WRITE) != 0:
                log.debug("prefault stopped at %d of %d bytes: %s", a - start, end - start,
                          os.strerror(ctypes.get_errno()))
                return
            self.done = min(end, a + self.CHUNK) - start

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class HostSlab:
    """``n_slots`` page-aligned slots of ``slot_bytes`` in one anonymous mapping.

    ``pin``: "auto" pins when CUDA is available, True asks for it (warns when impossible),
    False never pins. As many leading slots as the :class:`PinBudget` allows are pinned
    (``pinned_slots``, ``pinned_bytes``), the rest stay pageable; ``pinned`` is True when all
    are, and ``pin_note`` says what happened and why. A failed ``cudaHostRegister`` is cleared
    from the CUDA runtime and reported as a :class:`PinWarning`; the slab stays pageable.
    """

    def __init__(self, n_slots: int, slot_bytes: int, *, pin: bool | str = "auto",
                 budget: PinBudget | None = None, alignment: int = PAGE,
                 prefault: bool = True) -> None:
        if n_slots <= 0 or slot_bytes <= 0:
            raise IOUsageError(f"HostSlab({n_slots}, {slot_bytes}): both must be positive",
                               fix="size the slab from the extents it will hold")
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.stride = -(-slot_bytes // alignment) * alignment
        self.nbytes = self.stride * n_slots
        self.tensor = aligned_empty(self.nbytes, alignment=alignment, slab=True)
        self.pinned = False
        self.pinned_bytes = 0
        self.pin_note = "not pinned (pin=False)"
        self._budget = budget if budget is not None else default_pin_budget()
        if pin is True or pin == "auto":
            self._pin(required=pin is True)
        # pinning faulted the pinned part in; the rest in the background (``prefault``)
        self._prefault = Prefault(self.tensor[self.pinned_bytes:]) \
            if prefault and self.pinned_bytes < self.nbytes else None

    @property
    def pinned_slots(self) -> int:
        """Slots ``0 .. pinned_slots - 1`` are page-locked."""
        return self.pinned_bytes // self.stride

    def _pin(self, *, required: bool) -> None:
        level = logging.WARNING if required else logging.DEBUG
        if not torch.cuda.is_available():
            self.pin_note = "not pinned: CUDA is not available"
            log.log(level, "host slab of %d bytes %s", self.nbytes, self.pin_note)
            return
        n = self._budget.reserve_up_to(self.nbytes, self.stride)
        budget = (f"pin budget {self._budget.limit} bytes, {self._budget.used} in use; "
                  "raise EXPERTFS_PIN_BUDGET to pin more")
        if n == 0:
            self.pin_note = f"not pinned: the {budget}"
            log.log(level, "host slab of %d bytes %s", self.nbytes, self.pin_note)
            return
        try:
            err = _cuda_host_register(self.tensor.data_ptr(), n)
        except (RuntimeError, AttributeError) as e:
            err, detail = -1, str(e)
        else:
            detail = f"cudaHostRegister of {n} bytes returned {_cuda_error_name(err)}"
        if err != 0:
            _cuda_get_last_error()               # clear it: it is handled here
            self._budget.release(n)
            self.pin_note = f"not pinned: {detail}; using pageable memory (synchronous uploads)"
            warnings.warn(PinWarning(
                f"host slab of {self.nbytes} bytes {self.pin_note}. Fix: lower "
                "EXPERTFS_PIN_BUDGET or --ram, or raise the locked-memory limit (ulimit -l)"),
                stacklevel=3)
            return
        self.pinned_bytes = n
        self.pinned = n == self.nbytes
        self.pin_note = ("pinned with cudaHostRegister" if self.pinned else
                         f"{self.pinned_slots} of {self.n_slots} slots pinned ({budget}); "
                         "the rest pageable")
        if not self.pinned:
            log.log(level, "host slab of %d bytes: %s", self.nbytes, self.pin_note)

    def slot(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n_slots:
            raise IOUsageError(f"slot {i} is outside the slab's {self.n_slots} slots",
                               fix="index slots from 0 to n_slots - 1")
        return self.tensor[i * self.stride:i * self.stride + self.slot_bytes]

    def close(self) -> None:
        if self._prefault is not None:
            self._prefault.stop()
        n, self.pinned_bytes, self.pinned = self.pinned_bytes, 0, False
        if not n:
            return
        self._budget.release(n)
        try:
            err = _cuda_host_unregister(self.tensor.data_ptr())
        except (RuntimeError, AttributeError) as e:
            err, detail = -1, str(e)
        else:
            detail = f"returned {_cuda_error_name(err)}"
        if err != 0:
            _cuda_get_last_error()
            warnings.warn(PinWarning(
                f"cudaHostUnregister of a {n}-byte host slab {detail}: the memory may stay "
                "page-locked until the process exits. Fix: close slabs before CUDA shuts down"),
                stacklevel=2)

    def __enter__(self) -> HostSlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
