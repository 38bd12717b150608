"""Typed errors. Every error expertfs raises on purpose is an ``ExpertfsError``.

Its ``str()`` is one line a user can act on: the file, the rule that was broken and the fix.
The CLI turns these into exit status 2 (bad input) or 1 (a check that failed), never a traceback.
"""

from __future__ import annotations

import os


class ExpertfsError(Exception):
    """Base class: ``path`` names the file, ``problem`` the broken rule, ``fix`` what to do."""

    exit_code = 2

    def __init__(self, problem: str, *, path: str | os.PathLike[str] | None = None,
                 fix: str | None = None) -> None:
        self.problem = problem
        self.path = os.fspath(path) if path is not None else None
        self.fix = fix
        super().__init__(self.message())

    def message(self) -> str:
        head = f"{self.path}: {self.problem}" if self.path else self.problem
        return f"{head} ({self.fix})" if self.fix else head


class FormatError(ExpertfsError):
    """A GGUF file breaks a rule of the format (or of llama.cpp's reader)."""


class UnsupportedModelError(ExpertfsError):
    """A valid GGUF that expertfs cannot serve (for example a dense model with no experts)."""


class StoreError(ExpertfsError):
    """A store directory is missing, incomplete, of another format version, or damaged."""


class UsageError(ExpertfsError):
    """The command line asks for something that would lose data or cannot be done."""


class DiskFullError(ExpertfsError):
    """The output file system ran out of space; temporary files have been removed."""


class IntegrityError(ExpertfsError):
    """Bytes read back do not match their recorded checksum."""

    exit_code = 1
