"""The backend registry: names, availability, construction."""

from __future__ import annotations

from typing import Any

from .buffered import BufferedBackend
from .direct import DirectBackend
from .errors import BackendUnavailable, IOUsageError
from .kvikio_backend import KvikioBackend
from .mmap_backend import MmapBackend
from .protocol import Availability, IOBackend

__all__ = ["BACKENDS", "BACKEND_NAMES", "get_backend", "backend_status", "available_backends"]

BACKENDS: dict[str, type[IOBackend]] = {
    "kvikio": KvikioBackend,
    "direct": DirectBackend,
    "buffered": BufferedBackend,
    "mmap": MmapBackend,
}
#: every name ``backend=`` takes
BACKEND_NAMES: tuple[str, ...] = ("auto", *BACKENDS)


def _check_name(name: str) -> type[IOBackend]:
    cls = BACKENDS.get(name)
    if cls is None:
        raise IOUsageError(f"backend {name!r} is not known (expected one of: "
                           f"{', '.join(BACKEND_NAMES)})", fix="pick one of the listed backends")
    return cls


def get_backend(name: str, **options: Any) -> IOBackend:
    """A backend by name (not 'auto': see :func:`.auto.open_file`); raises
    :class:`BackendUnavailable` with the reason when it cannot run here."""
    if name == "auto":
        raise IOUsageError("'auto' chooses per file", fix="use expertfs.runtime.io.open_file(path)")
    cls = _check_name(name)
    avail = cls.availability()
    if not avail.available:
        raise BackendUnavailable(name, avail.reason)
    return cls(**options)


def backend_status() -> dict[str, Availability]:
    """Each backend's availability on this machine, with the reason."""
    return {name: cls.availability() for name, cls in BACKENDS.items()}


def available_backends(*, include_mmap: bool = True) -> list[str]:
    return [n for n, a in backend_status().items() if a.available and (include_mmap or n != "mmap")]
