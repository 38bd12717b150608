"""``kvikio``: reads with ``kvikio.CuFile`` into host buffers or straight into CUDA memory.

kvikio uses GPUDirect Storage where the platform supports it (cuFile with nvidia-fs) and its
POSIX compat mode with its own thread pool otherwise (``KVIKIO_COMPAT_MODE=AUTO``). Every read,
host buffers included, asks the CUDA driver what kind of memory the buffer is, so the backend
is available only where ``libcuda.so.1`` loads (the NVIDIA driver); elsewhere
:meth:`KvikioBackend.availability` says why and ``auto`` falls back. kvikio is an optional
extra (``pip install expertfs[kvikio]``); it is imported only when this backend is used.

Every way kvikio can fail before a read is a :class:`BackendUnavailable` with the reason, never
a crash: not installed, an import that fails for another cause (a missing libcufile), no
driver, ``CuFile`` refusing a file (a ``RuntimeError`` on a box with GDS misconfigured), and an
older kvikio without ``defaults.get``/``set`` (its older accessors are used, a setting it does
not know is left as it is).
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import logging
import os
import threading
from typing import Any

import numpy as np
import torch

from .buffers import host_view, is_device_buffer
from .errors import BackendUnavailable
from .protocol import DEFAULT_QUEUE_DEPTH, Availability, FileHandle, IOBackend, RawFile, open_fd
from .retry import RetryPolicy

__all__ = ["KvikioBackend"]

log = logging.getLogger(__name__)

_lock = threading.Lock()


def _import_kvikio() -> Any:
    try:
        kvikio = importlib.import_module("kvikio")
        importlib.import_module("kvikio.defaults")
        return kvikio
    except ImportError as e:
        raise BackendUnavailable("kvikio", f"kvikio is not installed ({e})",
                                 fix="pip install 'expertfs[kvikio]' on a machine with the NVIDIA "
                                     "driver, or use backend='direct'") from None
    except Exception as e:      # a library it loads is missing or broken (libcufile, CUDA)
        raise BackendUnavailable("kvikio", f"kvikio failed to import: {type(e).__name__}: {e}",
                                 fix="check the CUDA and cuFile installation, or use "
                                     "backend='direct'") from None


_SETTING_ERRORS = (KeyError, ValueError, RuntimeError, AttributeError, TypeError)
#: older kvikio (before ``defaults.get``/``set``): the accessor and the setter of each setting
_LEGACY = {"num_threads": ("get_num_threads", "num_threads_reset"),
           "task_size": ("task_size", "task_size_reset"),
           "compat_mode": ("compat_mode", "compat_mode_reset")}


def _get(kvikio: Any, key: str, default: Any) -> Any:
    """A kvikio setting, or ``default`` where this kvikio version has no such key."""
    d = getattr(kvikio, "defaults", None)
    try:
        return d.get(key)
    except _SETTING_ERRORS:
        pass
    for name in (_LEGACY.get(key, ("",))[0], key):
        fn = getattr(d, name, None) if name else None
        if callable(fn):
            try:
                return fn()
            except _SETTING_ERRORS:
                break
    return default


def _set(kvikio: Any, key: str, value: Any) -> bool:
    """Set a kvikio setting; False (logged) where this kvikio version cannot."""
    d = getattr(kvikio, "defaults", None)
    try:
        d.set(key, value)
        return True
    except _SETTING_ERRORS:
        pass
    fn = getattr(d, _LEGACY[key][1], None) if key in _LEGACY else None
    if callable(fn):
        try:
            fn(value)
            return True
        except _SETTING_ERRORS:
            pass
    log.debug("kvikio %s: cannot set %s; left at its default", getattr(kvikio, "__version__", "?"),
              key)
    return False


class _KvikioFile(RawFile):
    host_only = False

    def __init__(self, path: str, size: int, cufile: Any) -> None:
        super().__init__(path, size)
        self._f = cufile

    def prepare(self, buf: Any) -> Any:
        if isinstance(buf, torch.Tensor) and buf.device.type == "cuda":
            return buf.detach().reshape(-1).view(torch.uint8)
        if is_device_buffer(buf):
            return buf                     # a 1-D uint8 device array (cupy, numba)
        return np.frombuffer(host_view(buf), dtype=np.uint8)

    def pread_into(self, dest: Any, start: int, end: int, file_offset: int) -> int:
        n = end - start
        try:
            return int(self._f.pread(dest[start:end], size=n, file_offset=file_offset).get())
        except RuntimeError as e:      # kvikio reports failed reads as RuntimeError
            raise OSError(errno.EIO, f"kvikio: {e}") from e

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class KvikioBackend(IOBackend):
    """``nthreads``: kvikio's pool size (default: the handle's queue depth, at least 4);
    ``task_size``: bytes per pool task (kvikio's default 4 MiB); ``direct_io``: kvikio's POSIX
    path reads with O_DIRECT where it can (``auto_direct_io_read``), as the ``direct`` backend,
    or through the page cache (``False``), as the ``buffered`` one. In each mode kvikio reads
    within a few percent of its POSIX twin; which mode is faster depends on the drive and the
    queue depth, so ``auto`` gives kvikio the mode its probe measured faster
    (``bench/kvikio_ab.py`` measures both). kvikio keeps the setting per process: the handle
    opened last sets it for all."""

    name = "kvikio"

    def __init__(self, *, nthreads: int | None = None, task_size: int | None = None,
                 direct_io: bool = True) -> None:
        self.nthreads = nthreads
        self.task_size = task_size
        self.direct_io = direct_io

    @classmethod
    def availability(cls) -> Availability:
        try:
            _import_kvikio()
        except BackendUnavailable as e:
            return Availability(False, e.reason)
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            return Availability(False, "libcuda.so.1 (the NVIDIA driver) cannot be loaded: kvikio "
                                       f"needs the CUDA driver even for host buffers ({e})")
        return Availability(True, "kvikio imports and libcuda.so.1 loads")

    def mode(self) -> str:
        """'gds' when cuFile reads go GPUDirect, 'compat' when kvikio uses its POSIX path
        ('unknown' where this kvikio cannot say)."""
        kvikio = _import_kvikio()
        fn = getattr(kvikio.defaults, "is_compat_mode_preferred", None)
        try:
            compat = fn() if callable(fn) else _get(kvikio, "compat_mode", None)
        except _SETTING_ERRORS:
            compat = None
        return "unknown" if compat is None else "compat" if compat else "gds"

    def describe(self) -> str:
        try:
            kvikio = _import_kvikio()
            return (f"kvikio ({self.mode()} mode, {'O_DIRECT' if self.direct_io else 'page cache'}, "
                    f"{_get(kvikio, 'num_threads', '?')} threads, "
                    f"task {_get(kvikio, 'task_size', '?')} B)")
        except BackendUnavailable as e:
            return f"kvikio (unavailable: {e.reason})"

    def _configure(self, queue_depth: int) -> None:
        kvikio = _import_kvikio()
        want = self.nthreads or max(4, queue_depth)
        with _lock:
            # compat mode reads through the page cache unless asked: cold single expert reads
            # measured slower that way than with O_DIRECT (see bench/README.md)
            if _get(kvikio, "auto_direct_io_read", self.direct_io) != self.direct_io:
                _set(kvikio, "auto_direct_io_read", self.direct_io)
            n = _get(kvikio, "num_threads", None)
            if n is None or n < want:
                _set(kvikio, "num_threads", want)
            if self.task_size and _get(kvikio, "task_size", None) != self.task_size:
                _set(kvikio, "task_size", self.task_size)

    def open(self, path: str | os.PathLike[str], *, queue_depth: int = DEFAULT_QUEUE_DEPTH,
             max_pending: int | None = None, retry: RetryPolicy | None = None) -> FileHandle:
        self._configure(queue_depth)
        return super().open(path, queue_depth=queue_depth, max_pending=max_pending, retry=retry)

    def open_raw(self, path: str | os.PathLike[str]) -> RawFile:
        avail = self.availability()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, path=path,
                                     fix="use backend='direct' or 'auto' (it falls back)")
        kvikio = _import_kvikio()
        path, fd, size = open_fd(path)      # the same typed errors as every backend
        os.close(fd)
        try:
            f = kvikio.CuFile(path, "r")
        except Exception as e:          # cuFile's RuntimeError on a misconfigured GDS box
            raise BackendUnavailable(self.name, f"kvikio.CuFile cannot open the file: "
                                     f"{type(e).__name__}: {e}", path=path,
                                     fix="check GPUDirect Storage (nvidia-fs, cufile.json) or "
                                         "set KVIKIO_COMPAT_MODE=ON; or use backend='direct' "
                                         "('auto' falls back)") from None
        log.debug("%s: opened with %s", path, self.describe())
        return _KvikioFile(path, size, f)
