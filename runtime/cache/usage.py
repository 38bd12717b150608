"""Learned usage: how often each expert was routed, kept in the store for the next run.

The store's LMDB ``usage`` table maps (layer, expert) → count; it is empty after repack. A run
counts every routed expert (``UsageRecorder.add``) and, on close, adds its counts to the table in
one write transaction (atomic: all of a run's counts or none; merged: added to what earlier runs
left). The next run reads it back (``load_rates``) to warm its cache.

The runtime holds the store's index open read-only, and py-lmdb allows one environment per file
per process, so the write happens in a short child process (``_CHILD``: imports only the index,
not torch; counts as JSON on stdin; about 0.3 s). LMDB serialises writers across processes, so
concurrent runs on one store merge correctly too.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from expertfs.errors import StoreError

from ..policies.base import usage_rates

__all__ = ["UsageRecorder", "persist_usage", "load_rates"]

log = logging.getLogger(__name__)

_TIMEOUT_S = 60
_CHILD = """
import json, sys
from expertfs.errors import StoreError
from expertfs.store.index import Index
rows = json.loads(sys.stdin.read())
idx = Index.open(sys.argv[1], write=True)
try:
    if idx.env.flags()["readonly"]:
        raise StoreError("the index is read-only", path=sys.argv[1], fix="make the store writable")
    idx.add_usage({(int(la), int(e)): int(n) for la, e, n in rows})
finally:
    idx.close()
"""


class UsageRecorder:
    """Counts per (layer, expert) in memory; ``take()`` hands them over and starts again."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int], int] = {}

    def add(self, layer: int, experts: Iterable[int]) -> None:
        c = self.counts
        for e in experts:
            k = (layer, int(e))
            c[k] = c.get(k, 0) + 1

    def take(self) -> dict[tuple[int, int], int]:
        out, self.counts = self.counts, {}
        return out

    def __len__(self) -> int:
        return len(self.counts)


def _index_path(store: Any) -> str:
    return os.path.join(os.fspath(store.path), "index.lmdb")


def persist_usage(store: Any, counts: Mapping[tuple[int, int], int]) -> None:
    """Add ``counts`` to the store's usage table in one transaction (raises ``StoreError``)."""
    if not counts:
        return
    payload = json.dumps([[la, e, int(n)] for (la, e), n in counts.items()])
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD, _index_path(store)], input=payload,
                           capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise StoreError(f"could not record expert usage: {e}", path=store.path,
                         fix="check the store is writable; the run itself is unaffected") from None
    if r.returncode != 0:
        detail = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise StoreError(f"could not record expert usage: {detail}", path=store.path,
                         fix="check the store is writable; the run itself is unaffected")


def load_rates(store: Any, k: int) -> dict[tuple[int, int], float]:
    """The usage table as per-token access rates (``policies.usage_rates``); {} when empty."""
    usage = store.index.usage()
    return usage_rates(usage, k) if usage else {}
