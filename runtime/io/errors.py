"""Typed errors of the I/O engine. Each names the file, the rule that was broken and the fix."""

from __future__ import annotations

import os

from expertfs.errors import ExpertfsError, IntegrityError

__all__ = ["IOEngineError", "IOUsageError", "AlignmentError", "BackendUnavailable", "IOFaultError",
           "ExpertIntegrityError", "QueueFullError", "StoreChangedError"]


class IOEngineError(ExpertfsError):
    """Base of the I/O engine's own errors."""


class IOUsageError(IOEngineError):
    """A read was asked for that cannot be done: a buffer too small, a range past the end of the
    file, a device buffer given to a host-only backend, an unknown backend name."""


class AlignmentError(IOUsageError):
    """O_DIRECT in strict mode was given a buffer, offset or size off the alignment."""


class QueueFullError(IOEngineError):
    """A non-blocking submit found the bounded queue full of reads at least as urgent."""


class BackendUnavailable(IOEngineError):
    """A backend cannot run here (a missing library, driver or file-system feature)."""

    def __init__(self, name: str, reason: str, *, path: str | os.PathLike[str] | None = None,
                 fix: str | None = None) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"I/O backend {name!r} is unavailable: {reason}", path=path, fix=fix)


class IOFaultError(IOEngineError):
    """The device failed a read (EIO, repeated short reads) after every retry."""

    exit_code = 1

    def __init__(self, problem: str, *, path: str | os.PathLike[str], offset: int, size: int,
                 attempts: int, errno: int | None = None, layer: int | None = None,
                 expert: int | None = None) -> None:
        self.reason = problem
        self.offset = offset
        self.size = size
        self.attempts = attempts
        self.errno = errno
        self.layer, self.expert = layer, expert
        what = "" if layer is None else f"expert (layer {layer}, expert {expert}): "
        super().__init__(f"{what}read of {size} bytes at offset {offset} failed after {attempts} "
                         f"attempt(s): {problem}", path=path,
                         fix="check the drive (dmesg, smartctl) and run `expertfs verify` on the "
                             "store; repack it if the file is damaged")

    def for_expert(self, layer: int, expert: int) -> IOFaultError:
        """The same fault, naming the expert whose read it was."""
        return IOFaultError(self.reason, path=self.path or "", offset=self.offset, size=self.size,
                            attempts=self.attempts, errno=self.errno, layer=layer, expert=expert)


class StoreChangedError(IOEngineError):
    """The experts file was replaced, truncated or rewritten while an engine had it open: what
    is read from it now cannot be trusted to match the index the engine loaded."""

    exit_code = 1

    def __init__(self, change: str, *, path: str | os.PathLike[str], layer: int | None = None,
                 expert: int | None = None) -> None:
        self.change, self.layer, self.expert = change, layer, expert
        what = "" if layer is None else f" (reading layer {layer}, expert {expert})"
        super().__init__(f"the experts file changed under the running engine{what}: {change}",
                         path=path,
                         fix="never replace or truncate a store while it is served: restart the "
                             "engine (or server) on the new store, and run `expertfs verify` on it")


class ExpertIntegrityError(IntegrityError):
    """An expert's bytes do not match the checksum recorded in the index."""

    def __init__(self, *, path: str | os.PathLike[str], layer: int, expert: int, role: str,
                 offset: int, nbytes: int, expected: int, actual: int, attempts: int = 1) -> None:
        self.layer, self.expert, self.role = layer, expert, role
        self.offset, self.nbytes = offset, nbytes
        self.expected, self.actual, self.attempts = expected, actual, attempts
        super().__init__(
            f"expert (layer {layer}, expert {expert}) part {role}: xxh3 {actual:#018x} of the "
            f"{nbytes} bytes at offset {offset} does not match the recorded {expected:#018x}"
            f" ({attempts} read(s))",
            path=path,
            fix="run `expertfs verify` on the store; if it fails there too, repack it from the GGUF")
