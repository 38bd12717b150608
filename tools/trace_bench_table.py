"""Markdown table of ``expertfs bench cache --json`` reports: hit rate and ×Belady per policy.

    python tools/trace_bench_table.py NAME=REPORT.json [NAME=REPORT.json ...]

One row per (report, capacity point), one column per policy ("hit / ×OPT"), the best online
policy of the row in bold, and the Belady bound. Capacity is shown as slots and as the fraction
of the trace's MoE experts (``n_moe_layers`` from the trace meta that trace_trained_moe.py writes;
all layers otherwise), which is what a percentage given to the CLI should mean (the CLI's N%
counts every layer, dense ones too).
"""

from __future__ import annotations

import json
import sys

ORDER = ("lru", "lru/layer", "lfu", "lfud", "arc", "wlfu", "wlfu/layer")


def rows(name: str, report: dict) -> list[str]:
    tr = report["trace"]
    meta = tr.get("meta", {})
    n_moe_layers = int(meta.get("n_moe_layers", tr["n_layers"]))
    out = []
    for pt in report["points"]:
        pol = pt["policies"]
        opt = pt["belady_hit_rate"]
        fit = {p: v for p, v in pol.items() if isinstance(v, dict) and "hit_rate" in v}
        best = max(fit, key=lambda p: fit[p]["hit_rate"]) if fit else None
        cells = []
        for p in ORDER:
            v = fit.get(p)
            if v is None:
                cells.append("–")
                continue
            c = f"{v['hit_rate']:.3f} / {v['hit_rate'] / opt:.2f}" if opt else f"{v['hit_rate']:.3f}"
            cells.append(f"**{c}**" if p == best else c)
        frac = pt["ram_slots"] / (n_moe_layers * tr["n_experts"])
        out.append(f"| {name} | {pt['ram_slots']} ({frac:.1%}) | {opt:.3f} | " + " | ".join(cells)
                   + " |")
    return out


HEADER = ("| trace | RAM slots (of MoE experts) | Belady | " + " | ".join(ORDER) + " |\n"
          "|---|---|---|" + "---|" * len(ORDER) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(HEADER, end="")
    for a in args:
        name, _, path = a.partition("=")
        with open(path or name) as f:
            rep = json.load(f)
        for r in rows(name, rep):
            print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
