"""A PNG of GB/s against queue depth per backend, with the sequential ceiling (matplotlib)."""

from __future__ import annotations

import importlib
import os

from .bench import BenchReport
from .errors import IOUsageError

__all__ = ["plot_report"]


def plot_report(report: BenchReport, out: str | os.PathLike[str]) -> None:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise IOUsageError("--plot needs matplotlib, which is not installed", path=out,
                           fix="pip install 'expertfs[bench]' (or matplotlib)") from None
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in dict.fromkeys(p.backend for p in report.points):
        pts = sorted((p.qd, p.gbps) for p in report.points if p.backend == b)
        ax.plot([q for q, _ in pts], [g for _, g in pts], marker="o", label=b)
    if report.seq is not None:
        ax.axhline(report.seq.gbps, linestyle="--", color="grey",
                   label=f"sequential ({report.seq.backend})")
    ax.set_xscale("log", base=2)
    qds = sorted({p.qd for p in report.points})
    if qds:
        ax.set_xticks(qds, [str(q) for q in qds])
    ax.set_xlabel("queue depth")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{os.path.basename(report.path)}: random reads of {report.read_size // 1024} KiB, "
                 f"{'cold' if 'dropped' in report.cold else report.cold}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(os.fspath(out), dpi=110)
    except OSError as e:
        raise IOUsageError(f"cannot write the plot: {e.strerror}", path=out,
                           fix="choose a writable path") from None
    finally:
        plt.close(fig)
