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
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from expertfs.errors import StoreError

from ..policies.base import usage_rates

__all__ = ["UsageRecorder", "DYNAMICS", "prompt_coverage", "persist_usage", "load_rates"]

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
    idx.add_usage({(int(la), int(e)): int(n) for la, e, n in rows["counts"]}, rows["dynamics"])
finally:
    idx.close()
"""


#: the dynamics counters: decoded routes, those of them the run had routed to before, and of
#: the routes that follow another decoded token at their layer, those it had too; ``seen`` sums,
#: over the ``seen_routes`` counted with it, how many experts the run had routed to at that
#: layer before (a random pick is "reused" that often by chance alone). ``seen_routes`` equals a
#: run's ``routes`` but is its own counter: a store's merged counters hold older runs' routes,
#: which counted no ``seen``. Of prompts (``prompt_begin``/``prompt_end``): per layer a prompt
#: routed at, its tokens and the distinct experts they touched (``plan.routing.
#: learned_coverage``: how much of a layer a prompt reads, which a router's skew and a prompt's
#: repeated words both shrink).
DYNAMICS = ("routes", "reused", "follows", "kept", "seen", "seen_routes",
            "prompt_layers", "prompt_tokens", "prompt_experts")


class UsageRecorder:
    """Counts per (layer, expert) in memory; ``take()`` hands them over and starts again.

    With ``k`` (the model's top-k) it also counts how the run reuses experts. A call of at most
    ``k`` experts is one decoded token's route at that layer; ``routes`` counts its experts,
    ``kept`` those the previous decoded token routed to at that layer too, ``reused`` those the
    run routed to at that layer at any time before (the prompt included), and ``seen`` how
    many experts the run had routed to at that layer before, summed over the route's experts
    (``seen / seen_routes`` is what a random pick could have matched: after a long prompt, most
    of the layer). ``plan`` draws its
    replay's decode with these dynamics (``plan.routing.learned_dynamics``): how much of a
    run's decode stays within the experts its prompt and its last tokens touched decides the
    misses of a tier smaller than the model, and it differs by model and workload far more
    than the presets' spread."""

    def __init__(self, k: int = 0) -> None:
        self.counts: dict[tuple[int, int], int] = {}
        self.k = k
        self.dynamics = dict.fromkeys(DYNAMICS, 0)
        self._seen: dict[int, set[int]] = {}
        self._prev: dict[int, set[int]] = {}
        self._prompt: dict[int, set[int]] | None = None

    def prompt_begin(self) -> None:
        """A prompt's batches follow: count the distinct experts they touch per layer."""
        self._prompt = {}

    def prompt_end(self, tokens: int) -> None:
        """The prompt of ``tokens`` tokens begun with ``prompt_begin`` is in."""
        touched, self._prompt = self._prompt or {}, None
        d = self.dynamics
        for experts in touched.values():
            d["prompt_layers"] += 1
            d["prompt_tokens"] += tokens
            d["prompt_experts"] += len(experts)

    def add(self, layer: int, experts: Iterable[int]) -> None:
        c = self.counts
        ids = [int(e) for e in experts]
        for e in ids:
            k = (layer, e)
            c[k] = c.get(k, 0) + 1
        if self._prompt is not None:
            self._prompt.setdefault(layer, set()).update(ids)
        if self.k:
            seen = self._seen.setdefault(layer, set())
            prev = self._prev.pop(layer, None)
            if len(ids) <= self.k:
                d = self.dynamics
                d["routes"] += len(ids)
                d["reused"] += sum(1 for e in ids if e in seen)
                d["seen"] += len(ids) * len(seen)
                d["seen_routes"] += len(ids)
                if prev is not None:
                    d["follows"] += len(ids)
                    d["kept"] += sum(1 for e in ids if e in prev)
                self._prev[layer] = set(ids)
            seen.update(ids)

    def take(self) -> tuple[dict[tuple[int, int], int], dict[str, int]]:
        """The counts and the dynamics counters so far; both start again (what the run routed
        to is kept: the run goes on)."""
        out, self.counts = self.counts, {}
        dyn, self.dynamics = self.dynamics, dict.fromkeys(DYNAMICS, 0)
        return out, dyn

    def __len__(self) -> int:
        return len(self.counts)


@contextmanager
def prompt_coverage(provider: Any, tokens: int) -> Iterator[None]:
    """Count the prompt of ``tokens`` tokens the block feeds in ``provider``'s usage recorder,
    where it keeps one (a prompt that raises is not counted)."""
    rec = getattr(provider, "usage", None)
    if not isinstance(rec, UsageRecorder):
        yield
        return
    rec.prompt_begin()
    yield
    rec.prompt_end(tokens)


def _index_path(store: Any) -> str:
    return os.path.join(os.fspath(store.path), "index.lmdb")


def persist_usage(store: Any, counts: Mapping[tuple[int, int], int],
                  dynamics: Mapping[str, int] | None = None) -> None:
    """Add ``counts`` to the store's usage table, and ``dynamics`` to its counters, in one
    transaction (raises ``StoreError``)."""
    if not counts:
        return
    payload = json.dumps({"counts": [[la, e, int(n)] for (la, e), n in counts.items()],
                          "dynamics": {k: int(n) for k, n in (dynamics or {}).items() if n}})
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
