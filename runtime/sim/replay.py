"""Replay a routing trace against a two-tier expert cache (VRAM above RAM) and count what moves.

Tiers are **exclusive** by default: an expert is in VRAM or in RAM, not both. A RAM hit moves the
expert up (RAM → VRAM upload) and frees its RAM slot; a VRAM eviction demotes the expert to RAM
(a device → host copy), and a RAM eviction drops it. Why: on the boxes this targets, the VRAM cache
is about as large as the RAM cache (24 GB card, ~16–20 GB of RAM for experts), so inclusion would
spend most of the RAM tier on duplicates; a demotion costs a PCIe copy, much cheaper than the
NVMe read it saves (a PCIe 4.0 x16 link moves several times what one drive reads; the copy is
counted, as ``d2h``). ``inclusive=True`` simulates the other choice (RAM keeps a copy of
everything in VRAM; VRAM evictions are free; a RAM eviction also drops the VRAM copy) so the two
can be compared on a trace.

``vram=0`` is the CPU-only runtime: one RAM tier, experts computed from RAM. Capacities are in
slots (fixed-size, one expert each); byte budgets become slots via ``slots_for``. Every row pins
its keys in both tiers while it is served. The clock given to policies is the token index.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import numpy as np

from ...errors import UsageError
from ..policies.base import Policy
from ..trace.file import TraceChunk, TraceHeader, TraceReader

__all__ = ["Replay", "SimResult", "simulate", "slots_for", "usage_counts"]


@dataclass(frozen=True)
class Replay:
    """A trace ready to replay: rows of integer keys ``layer * n_experts + expert``."""

    header: TraceHeader
    rows: list[list[int]]             # distinct keys needed at once (a route, plus drafts)
    clock: list[int]                  # token index of each row
    n_tokens: int

    @classmethod
    def from_chunks(cls, header: TraceHeader, chunks: Iterable[TraceChunk], *,
                    include_drafts: bool = False) -> Replay:
        E = header.n_experts
        rows: list[list[int]] = []
        clock: list[int] = []
        tokens: set[int] = set()
        for c in chunks:
            base = c.layers.astype(np.int64)[:, None] * E
            keys = (base + c.experts).tolist()
            if include_drafts and c.draft_experts is not None:
                dk = (base[:, :, None] + c.draft_experts).tolist()
                for r, d, n in zip(keys, dk, c.n_valid.tolist()):
                    extra = [x for route in d[:n] for x in route]
                    r.extend(dict.fromkeys(x for x in extra if x not in r))
            rows.extend(keys)
            t = c.tokens.tolist()
            clock.extend(t)
            tokens.update(t)
        return cls(header, rows, clock, len(tokens))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, include_drafts: bool = False,
                  allow_partial: bool = False) -> Replay:
        with TraceReader(path, allow_partial=allow_partial) as r:
            return cls.from_chunks(r.header, r.chunks(), include_drafts=include_drafts)

    def key_bytes(self, key: int) -> int:
        return self.header.expert_bytes[key // self.header.n_experts]

    def layer_of(self, key: int) -> int:
        return key // self.header.n_experts

    def split(self, tokens: int) -> tuple[Replay, Replay]:
        """The rows of the first ``tokens`` distinct tokens, and the rest."""
        seen: set[int] = set()
        cut = len(self.rows)
        for i, t in enumerate(self.clock):
            if t not in seen:
                if len(seen) == tokens:
                    cut = i
                    break
                seen.add(t)
        a = Replay(self.header, self.rows[:cut], self.clock[:cut], len(seen))
        return a, Replay(self.header, self.rows[cut:], self.clock[cut:],
                         len(set(self.clock[cut:])))


def usage_counts(replay: Replay) -> dict[tuple[int, int], int]:
    """``(layer, expert) -> uses``: what the store's usage table would learn from this run."""
    E = replay.header.n_experts
    out: dict[tuple[int, int], int] = {}
    for row in replay.rows:
        for key in row:
            lk = divmod(key, E)
            out[lk] = out.get(lk, 0) + 1
    return out


def slots_for(budget_bytes: int, header: TraceHeader) -> int:
    """Fixed slots a byte budget holds: each slot fits the largest expert of the model."""
    return budget_bytes // max(header.expert_bytes)


@dataclass
class SimResult:
    policy: str
    vram_slots: int
    ram_slots: int
    inclusive: bool
    tokens: int = 0
    accesses: int = 0
    vram_hits: int = 0
    ram_hits: int = 0
    misses: int = 0
    bytes_nvme: int = 0               # read from the store (misses)
    bytes_h2d: int = 0                # uploaded host -> device (RAM hits and misses, GPU runs)
    bytes_d2h: int = 0                # demoted device -> host (exclusive tiers)
    bytes_warm: int = 0               # loaded by the warm start, before the first token

    @property
    def vram_hit_rate(self) -> float:
        return self.vram_hits / self.accesses if self.accesses else 0.0

    @property
    def ram_hit_rate(self) -> float:
        """Share of all accesses served by RAM (not: RAM hits / VRAM misses)."""
        return self.ram_hits / self.accesses if self.accesses else 0.0

    @property
    def hit_rate(self) -> float:
        """Share of accesses that did not read the store."""
        return 1.0 - self.misses / self.accesses if self.accesses else 0.0

    def per_token(self, nbytes: int) -> float:
        return nbytes / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = asdict(self)
        d.update(hit_rate=self.hit_rate, vram_hit_rate=self.vram_hit_rate,
                 ram_hit_rate=self.ram_hit_rate, nvme_bytes_per_token=self.per_token(self.bytes_nvme),
                 h2d_bytes_per_token=self.per_token(self.bytes_h2d),
                 d2h_bytes_per_token=self.per_token(self.bytes_d2h))
        return d


PolicyFactory = Callable[[int], Policy]


def simulate(replay: Replay, factory: PolicyFactory, *, vram: int, ram: int,
             inclusive: bool = False, warm: Mapping[tuple[int, int], float] | None = None
             ) -> SimResult:
    """Replay ``replay`` with ``factory(slots)`` as the policy of each tier (``vram``/``ram`` slots).

    ``warm``: per-token usage rates ``(layer, expert) -> rate`` (``usage_rates``) to seed both
    tiers before the first token; what that loads is counted in ``bytes_warm``, not per token.
    """
    widest = max((len(r) for r in replay.rows), default=0)
    for tier, n in (("vram", vram), ("ram", ram)):
        if n and n < widest:
            raise UsageError(f"the {tier} tier has {n} slots but a layer needs {widest} experts at "
                             "once", fix=f"give --{tier} at least {widest} slots or 0 (no tier)")
    if not vram and not ram:
        raise UsageError("no cache tier", fix="give a RAM or a VRAM capacity")
    if inclusive and vram > ram:
        raise UsageError(f"inclusive tiers need RAM >= VRAM ({ram} < {vram} slots)",
                         fix="give more RAM, or use exclusive tiers")
    V = factory(vram) if vram else None
    R = factory(ram) if ram else None
    top = V if V is not None else R
    assert top is not None
    res = SimResult(top.name, vram, ram, inclusive, tokens=replay.n_tokens)
    if warm:
        _seed(replay, V, R, warm, res, inclusive)
    if V is None:
        _run_single(replay, R, res)  # type: ignore[arg-type]
    elif inclusive:
        _run_inclusive(replay, V, R, res)
    else:
        _run_exclusive(replay, V, R, res)
    return res


def _seed(replay: Replay, V: Policy | None, R: Policy | None, warm: Mapping[tuple[int, int], float],
          res: SimResult, inclusive: bool) -> None:
    E = replay.header.n_experts
    rates = {la * E + e: r for (la, e), r in warm.items() if 0 <= e < E}
    loaded = set(V.seed(rates, 0) if V is not None else ())
    if R is not None:
        rest = rates if inclusive else {k: r for k, r in rates.items() if k not in loaded}
        loaded.update(R.seed(rest, 0))
    res.bytes_warm = sum(replay.key_bytes(k) for k in loaded)


def _run_single(rp: Replay, R: Policy, res: SimResult) -> None:
    size = rp.header.expert_bytes
    E = rp.header.n_experts
    pinned = R.pinned
    hits = acc = nvme = 0
    for row, now in zip(rp.rows, rp.clock):
        pinned.clear()
        pinned.update(row)
        for key in row:
            acc += 1
            if R.access(key, now):
                hits += 1
                continue
            nvme += size[key // E]
            R.admit(key, now)
    res.accesses, res.ram_hits, res.misses, res.bytes_nvme = acc, hits, acc - hits, nvme


def _run_exclusive(rp: Replay, V: Policy, R: Policy | None, res: SimResult) -> None:
    size = rp.header.expert_bytes
    E = rp.header.n_experts
    pv = V.pinned
    pr = R.pinned if R is not None else set()
    vh = rh = acc = nvme = h2d = d2h = 0
    for row, now in zip(rp.rows, rp.clock):
        pv.clear()
        pv.update(row)
        pr.clear()
        pr.update(row)
        for key in row:
            acc += 1
            if V.access(key, now):
                vh += 1
                if R is not None:
                    R.observe(key, now)
                continue
            b = size[key // E]
            h2d += b
            if R is not None and R.access(key, now):
                rh += 1
                R.on_evict(key)                      # moves up: exclusive
            else:
                nvme += b
            v = V.victim(key)
            if v is not None:
                V.on_evict(v)
                if R is not None:                    # demote to RAM
                    d2h += size[v // E]
                    R.admit(v, now)
            V.on_insert(key, now)
    res.accesses, res.vram_hits, res.ram_hits = acc, vh, rh
    res.misses, res.bytes_nvme, res.bytes_h2d, res.bytes_d2h = acc - vh - rh, nvme, h2d, d2h


def _run_inclusive(rp: Replay, V: Policy, R: Policy | None, res: SimResult) -> None:
    size = rp.header.expert_bytes
    E = rp.header.n_experts
    pv = V.pinned
    pr = R.pinned if R is not None else set()
    vh = rh = acc = nvme = h2d = 0
    for row, now in zip(rp.rows, rp.clock):
        pv.clear()
        pv.update(row)
        pr.clear()
        pr.update(row)
        for key in row:
            acc += 1
            in_ram = R.access(key, now) if R is not None else False
            if V.access(key, now):
                vh += 1
                continue
            b = size[key // E]
            h2d += b
            if in_ram:
                rh += 1
            else:
                nvme += b
                if R is not None:
                    r = R.victim(key)
                    if r is not None:
                        R.on_evict(r)
                        if r in V:                   # keep inclusion: drop the VRAM copy too
                            V.on_evict(r)
                    R.on_insert(key, now)
            V.admit(key, now)
    res.accesses, res.vram_hits, res.ram_hits = acc, vh, rh
    res.misses, res.bytes_nvme, res.bytes_h2d = acc - vh - rh, nvme, h2d
