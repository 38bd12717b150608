"""A policy × capacity sweep over one trace, beside the Belady bound: the data of ``bench cache``.

For each capacity point (VRAM slots, RAM slots) it replays every policy (``simulate``) and
computes the bounds: VRAM hits ≤ OPT(VRAM slots); hits in either tier ≤ OPT(VRAM + RAM slots)
for exclusive tiers, OPT(RAM slots) for inclusive ones (each is a demand-fetch cache of that
many slots, so MIN bounds it). Beside Belady, the static-frequency cache of as many slots (the
most used experts pinned: the best a cache that knows frequencies but not order can do on
independent routes; ``sim.bounds``) shows how much of Belady's margin is knowing the order.
Results are plain data (``as_dict``), a text table, or a PNG.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ...errors import UsageError
from ..policies.base import CapacityError
from .bounds import belady_hits, static_hits
from ..policies.registry import DEFAULT_POLICY, make_factory
from .replay import Replay, SimResult, simulate

__all__ = ["Point", "PointResult", "Sweep", "run_sweep", "format_sweep", "plot_sweep"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Point:
    vram: int                        # slots (0: no VRAM tier, the CPU runtime)
    ram: int                         # slots (0: no RAM tier)


@dataclass
class PointResult:
    point: Point
    opt_total: float                 # Belady hit rate for "not read from the store"
    opt_vram: float | None           # Belady hit rate of the VRAM tier alone
    static_total: float              # the static-frequency cache's, as many slots as opt_total
    results: dict[str, SimResult | None] = field(default_factory=dict)   # None: does not fit

    def as_dict(self, slot_bytes: int) -> dict[str, object]:
        out: dict[str, object] = {
            "vram_slots": self.point.vram, "ram_slots": self.point.ram,
            "vram_bytes": self.point.vram * slot_bytes, "ram_bytes": self.point.ram * slot_bytes,
            "belady_hit_rate": self.opt_total, "belady_vram_hit_rate": self.opt_vram,
            "static_hit_rate": self.static_total, "policies": {}}
        for name, r in self.results.items():
            d = None if r is None else {**r.as_dict(), "vs_belady": _ratio(r.hit_rate, self.opt_total),
                                        "vram_vs_belady": _ratio(r.vram_hit_rate, self.opt_vram),
                                        "vs_static": _ratio(r.hit_rate, self.static_total)}
            out["policies"][name] = d  # type: ignore[index]
        return out


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


@dataclass
class Sweep:
    replay: Replay
    inclusive: bool
    warm: bool
    points: list[PointResult]

    @property
    def slot_bytes(self) -> int:
        return max(self.replay.header.expert_bytes)

    def as_dict(self) -> dict[str, object]:
        h, rp = self.replay.header, self.replay
        return {"trace": {"n_layers": h.n_layers, "n_experts": h.n_experts, "k": h.k,
                          "n_draft": h.n_draft, "slot_bytes": self.slot_bytes,
                          "tokens": rp.n_tokens, "accesses": sum(len(r) for r in rp.rows),
                          "meta": dict(h.meta)},
                "tiers": "inclusive" if self.inclusive else "exclusive", "warm": self.warm,
                "default_policy": DEFAULT_POLICY,
                "points": [p.as_dict(self.slot_bytes) for p in self.points]}


def run_sweep(replay: Replay, policies: Sequence[str], points: Sequence[Point], *,
              inclusive: bool = False, warm: Mapping[tuple[int, int], float] | None = None,
              progress: Callable[[str], None] | None = None) -> Sweep:
    """Every policy at every point, with the bounds (prefilled Belady when ``warm`` is given)."""
    h = replay.header
    width = max((len(r) for r in replay.rows), default=h.k)
    opt_cache: dict[int, float] = {}
    static_cache: dict[int, float] = {}
    n = sum(len(r) for r in replay.rows)
    if n == 0:
        raise UsageError("the trace has no rows", fix="record or generate a longer trace")

    def opt(slots: int) -> float:
        if slots not in opt_cache:
            opt_cache[slots] = belady_hits(replay.rows, slots, prefill=bool(warm)) / n
        return opt_cache[slots]

    def static(slots: int) -> float:
        if slots not in static_cache:
            static_cache[slots] = static_hits(replay.rows, slots, prefill=bool(warm)) / n
        return static_cache[slots]

    out = []
    for pt in points:
        total = pt.ram if inclusive else pt.vram + pt.ram
        if min(s for s in (pt.vram, pt.ram, total) if s) < width:
            raise UsageError(f"capacity point vram={pt.vram}, ram={pt.ram} slots: a layer needs "
                             f"{width} experts at once", fix=f"give every tier at least {width} slots")
        pr = PointResult(pt, opt(total), opt(pt.vram) if pt.vram else None, static(total))
        for name in policies:
            f = make_factory(name, n_layers=h.n_layers, route_width=width, layer_of=replay.layer_of)
            try:
                pr.results[name] = simulate(replay, f, vram=pt.vram, ram=pt.ram,
                                            inclusive=inclusive, warm=warm)
            except (CapacityError, UsageError) as e:
                log.info("%s at vram=%d ram=%d: %s", name, pt.vram, pt.ram, e)
                pr.results[name] = None
            if progress:
                progress(f"{name} vram={pt.vram} ram={pt.ram}")
        out.append(pr)
    return Sweep(replay, inclusive, bool(warm), out)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}G"


def format_sweep(s: Sweep) -> str:
    """A fixed-width table: one block per capacity point, one line per policy plus Belady."""
    h, sb = s.replay.header, s.slot_bytes
    mib = 1 << 20
    lines = [f"trace: {h.n_layers} layers x {h.n_experts} experts, top-{h.k}, "
             f"{s.replay.n_tokens} tokens, slot {sb / mib:.2f} MiB; tiers "
             f"{'inclusive' if s.inclusive else 'exclusive'}{', warm start' if s.warm else ''}; "
             f"default policy {DEFAULT_POLICY}",
             f"{'policy':<14}{'hit':>7}{'xOPT':>7}{'vram':>7}{'xOPT':>7}{'ram':>7}"
             f"{'NVMe MiB/tok':>14}{'H2D MiB/tok':>13}{'D2H MiB/tok':>13}"]
    for p in s.points:
        pt = p.point
        lines.append(f"-- vram {pt.vram} slots ({_gib(pt.vram * sb)}), ram {pt.ram} slots "
                     f"({_gib(pt.ram * sb)})")
        ov = "" if p.opt_vram is None else f"{p.opt_vram:7.3f}"
        lines.append(f"{'belady (OPT)':<14}{p.opt_total:7.3f}{'':>7}{ov:>7}")
        lines.append(f"{'static (freq)':<14}{p.static_total:7.3f}"
                     f"{_ratio(p.static_total, p.opt_total) or 0:7.3f}")
        for name, r in p.results.items():
            if r is None:
                lines.append(f"{name:<14}  does not fit (a layer's quota is below its route)")
                continue
            vr = f"{r.vram_hit_rate:7.3f}{_ratio(r.vram_hit_rate, p.opt_vram) or 0:7.3f}" if pt.vram \
                else f"{'':>14}"
            ratio = f"{r.hit_rate / p.opt_total:7.3f}" if p.opt_total else f"{'-':>7}"
            lines.append(f"{name:<14}{r.hit_rate:7.3f}{ratio}{vr}"
                         f"{r.ram_hit_rate:7.3f}{r.per_token(r.bytes_nvme) / mib:14.1f}"
                         f"{r.per_token(r.bytes_h2d) / mib:13.1f}{r.per_token(r.bytes_d2h) / mib:13.1f}")
    return "\n".join(lines)


def plot_sweep(s: Sweep, path: str | os.PathLike[str]) -> None:
    """PNG: hit rate against capacity, Belady dashed. With several RAM sizes: x = RAM, one panel
    per VRAM size; with one RAM size: x = VRAM, one panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = s.slot_bytes / (1 << 30)
    by_ram = len({p.point.ram for p in s.points}) > 1
    groups = sorted({p.point.vram if by_ram else p.point.ram for p in s.points})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, g in zip(axes[0], groups):
        def xof(p: PointResult) -> int:
            return p.point.ram if by_ram else p.point.vram
        pts = sorted((p for p in s.points if (p.point.vram if by_ram else p.point.ram) == g), key=xof)
        x = [xof(p) * gib for p in pts]
        ax.plot(x, [p.opt_total for p in pts], "k--", marker="o", label="Belady (OPT)")
        ax.plot(x, [p.static_total for p in pts], "k:", marker="x",
                label="static frequency (knows frequencies, not order)")
        for name in pts[0].results:
            y = [r.hit_rate if (r := p.results.get(name)) else float("nan") for p in pts]
            ax.plot(x, y, marker=".", label=name)
        ax.set_xlabel(f"{'RAM' if by_ram else 'VRAM'} tier (GiB)")
        ax.set_ylabel("hit rate (not read from NVMe)")
        other = "VRAM" if by_ram else "RAM"
        ax.set_title(f"{other} tier {g * gib:.2f} GiB" if g else f"no {other} tier")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
