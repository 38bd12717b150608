"""The repack copy schedule (pure): the plan cut into windows of output bytes.

A window is a contiguous range of one output file that the writer fills in one aligned buffer
and writes with one call: which source ranges land where in the buffer (``Copy``), which
checksums advance (``HashOp``) and which records are complete once it is written. Everything
in a window not covered by a copy is zero. Windows never cut an expert extent; a trunk tensor
larger than a window spans several, and no checkpoint is taken inside it
(``Window.checkpoint``), so a resumed repack never needs a half-finished checksum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from .layout import EXPERTS_FILE, TRUNK_FILE
from .plan import LayerPlan, RepackPlan, TrunkPlan, align_up

__all__ = ["Copy", "HashOp", "Window", "windows", "DEFAULT_WINDOW"]

DEFAULT_WINDOW = 32 << 20


@dataclass(frozen=True)
class Copy:
    buf_off: int
    length: int
    shard: int
    src_off: int


@dataclass(frozen=True)
class HashOp:
    item: tuple[int, ...]       # (layer, expert, part) for an expert part, (tensor_index,) for trunk
    buf_off: int
    length: int
    last: bool                  # the item's checksum is complete after this op


@dataclass
class Window:
    file: str                   # EXPERTS_FILE or TRUNK_FILE
    dst_off: int
    length: int                 # a multiple of the store alignment
    copies: list[Copy] = field(default_factory=list)
    hashes: list[HashOp] = field(default_factory=list)
    extents: list[tuple[LayerPlan, int]] = field(default_factory=list)   # completed extents
    trunk: list[TrunkPlan] = field(default_factory=list)                 # completed trunk tensors
    checkpoint: bool = True     # no item continues into the next window

    @property
    def payload(self) -> int:
        return sum(c.length for c in self.copies)


def windows(plan: RepackPlan, window_bytes: int = DEFAULT_WINDOW) -> Iterator[Window]:
    """Every window of trunk.bin, then of experts.bin, in file order."""
    yield from _trunk_windows(plan, window_bytes)
    for lp in plan.layers:
        yield from _layer_windows(plan, lp, window_bytes)


def window_capacity(plan: RepackPlan, window_bytes: int = DEFAULT_WINDOW) -> int:
    """The largest window ``windows`` makes: a buffer of this size holds any of them."""
    largest = max((lp.extent_len for lp in plan.layers), default=0)
    return max(align_up(window_bytes, plan.alignment), largest)


def _trunk_windows(plan: RepackPlan, window_bytes: int) -> Iterator[Window]:
    model, a = plan.model, plan.alignment
    cap = align_up(window_bytes, a)
    cur: Window | None = None
    for tp in plan.trunk:
        t = model.tensors[tp.tensor_index]
        span = align_up(max(tp.nbytes, 1), a)
        if cur is not None and cur.length + span > cap:
            yield cur
            cur = None
        if span <= cap:
            if cur is None:
                cur = Window(TRUNK_FILE, tp.offset, 0)
            base = tp.offset - cur.dst_off
            if tp.nbytes:
                cur.copies.append(Copy(base, tp.nbytes, t.shard, t.data_start))
            cur.hashes.append(HashOp((tp.tensor_index,), base, tp.nbytes, True))
            cur.trunk.append(tp)
            cur.length = base + span
            continue
        for start in range(0, tp.nbytes, cap):         # one tensor over several windows
            n = min(cap, tp.nbytes - start)
            last = start + n >= tp.nbytes
            w = Window(TRUNK_FILE, tp.offset + start, align_up(n, a) if last else n,
                       [Copy(0, n, t.shard, t.data_start + start)],
                       [HashOp((tp.tensor_index,), 0, n, last)], checkpoint=last)
            if last:
                w.trunk.append(tp)
            yield w
    if cur is not None:
        yield cur


def _layer_windows(plan: RepackPlan, lp: LayerPlan, window_bytes: int) -> Iterator[Window]:
    model = plan.model
    per = max(1, window_bytes // lp.extent_len)
    for e0 in range(0, lp.n_experts, per):
        e1 = min(lp.n_experts, e0 + per)
        w = Window(EXPERTS_FILE, lp.extent_offset(e0), (e1 - e0) * lp.extent_len)
        for e in range(e0, e1):
            base = (e - e0) * lp.extent_len
            for pi, p in enumerate(lp.parts):
                t = model.tensors[p.tensor_index]
                w.copies.append(Copy(base + p.rel_offset, p.nbytes, t.shard, t.data_start + e * p.nbytes))
                w.hashes.append(HashOp((lp.layer, e, pi), base + p.rel_offset, p.nbytes, True))
            w.extents.append((lp, e))
        yield w
