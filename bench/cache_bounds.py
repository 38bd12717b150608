#!/usr/bin/env python3
"""How much future a cache must know to come near the Belady bound (issue 4's 0.97× target).

For each trace and capacity (slots, demand fetch, the running row pinned, as ``bench cache``):

- Belady (OPT): knows every future route;
- *window W*: knows the exact routes of the next W tokens (and of the current token's later
  layers): it evicts the resident expert whose next use is farthest, experts with no use in the
  window first (least used so far, then least recently used). W of 1–3 is what MTP drafts could
  tell at best (their routes are guesses, these are exact);
- the static-frequency cache: knows how often each expert is used, not when (``sim.bounds``);
- the default online policy and LRU, which know only the past.

Prints a table of hit rates and their fraction of Belady; ``--json`` the figures.

    .venv/bin/python bench/cache_bounds.py OUT/traces/decode.efstrace --capacity 12.5%,25%,50%
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expertfs.runtime.sim.bounds import (belady_hits, check_capacity, next_uses,  # noqa: E402
                                           static_hits)
from expertfs.runtime.policies.registry import DEFAULT_POLICY, make_factory  # noqa: E402
from expertfs.runtime.sim.replay import Replay, simulate  # noqa: E402


def window_hits(rp: Replay, capacity: int, window: int) -> int:
    """Hits of the cache that knows the routes of the next ``window`` tokens (module doc)."""
    check_capacity(rp.rows, capacity)
    seq = [k for row in rp.rows for k in row]
    tok = np.array([rp.clock[r] for r, row in enumerate(rp.rows) for _ in row], dtype=np.int64)
    nxt = np.array(next_uses(seq), dtype=np.int64)
    nxt_tok = np.append(tok, np.iinfo(np.int64).max // 2)[nxt]     # token of each next use
    K = max(seq, default=0) + 1
    resident = np.zeros(K, dtype=bool)
    nu = np.zeros(K, dtype=np.int64)            # position of each resident key's next use
    nu_tok = np.zeros(K, dtype=np.int64)
    count = np.zeros(K, dtype=np.int64)
    last = np.zeros(K, dtype=np.int64)
    size = hits = i = 0
    for row in rp.rows:
        t = tok[i]
        for key in row:
            if resident[key]:
                hits += 1
            elif size >= capacity:
                cand = resident.copy()
                cand[row] = False
                far = cand & (nu_tok - t > window)
                if far.any():                    # no use in the window: least used, then oldest
                    c = np.where(far, count, np.iinfo(np.int64).max)
                    low = np.flatnonzero(c == c.min())
                    victim = low[np.argmin(last[low])]
                else:                            # all used in the window: the farthest
                    victim = int(np.argmax(np.where(cand, nu, -1)))
                resident[victim] = False
                size -= 1
            if not resident[key]:
                resident[key] = True
                size += 1
            count[key] += 1
            last[key] = i
            nu[key], nu_tok[key] = nxt[i], nxt_tok[i]
            i += 1
    return hits


def slots_of(spec: str, rp: Replay) -> int:
    if spec.endswith("%"):
        keys = len({k for row in rp.rows for k in row})
        return max(round(keys * float(spec[:-1]) / 100), max(len(r) for r in rp.rows))
    return int(spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--capacity", default="12.5%,25%,50%",
                    help="slots, or percentages of the experts the trace uses (12.5%%,25%%,50%%)")
    ap.add_argument("--windows", default="1,2,4,8,16", help="tokens of future known (1,2,4,8,16)")
    ap.add_argument("--drafts", action="store_true", help="replay route ∪ draft routes (MTP traces)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    windows = [int(w) for w in a.windows.split(",")]
    report = []
    for path in a.traces:
        rp = Replay.from_file(path, include_drafts=a.drafts)
        n = sum(len(r) for r in rp.rows)
        width = max(len(r) for r in rp.rows)
        for spec in a.capacity.split(","):
            C = slots_of(spec, rp)
            t0 = time.perf_counter()
            opt = belady_hits(rp.rows, C) / n
            row = {"trace": path, "slots": C, "belady": opt, "static": static_hits(rp.rows, C) / n,
                   "windows": {w: window_hits(rp, C, w) / n for w in windows}}
            for name in (DEFAULT_POLICY, "lru"):
                f = make_factory(name, n_layers=rp.header.n_layers, route_width=width,
                                 layer_of=rp.layer_of)
                row[name] = simulate(rp, f, vram=0, ram=C).hit_rate
            row["seconds"] = time.perf_counter() - t0
            report.append(row)
            if not a.json:
                def cell(h: float) -> str:
                    return f"{h:.3f} ({h / opt:.2f})" if opt else f"{h:.3f}"
                ws = "  ".join(f"W={w}: {cell(h)}" for w, h in row["windows"].items())
                name = "/".join(os.path.normpath(path).split(os.sep)[-3:])
                print(f"{name} {C} slots | belady {opt:.3f} | {ws} | "
                      f"static {cell(row['static'])} | {DEFAULT_POLICY} {cell(row[DEFAULT_POLICY])}"
                      f" | lru {cell(row['lru'])}", flush=True)
    if a.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
