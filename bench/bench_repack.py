#!/usr/bin/env python3
"""Repack throughput and memory against ``cp`` of the same GGUF to the same disk.

For each model size: synthesise a model (``expertfs synth --like ... --size``), then, with the
page cache dropped before each run, time ``cp MODEL COPY && sync`` (the peer: the same bytes
read and written durably; plain ``cp`` without the sync is reported too) and
``expertfs repack MODEL -o STORE`` (which syncs before publishing), and read each process's
peak RSS from the kernel (wait4). Prints a table and, with ``--json``, the raw figures.

    sudo .venv/bin/python bench/bench_repack.py --sizes 1G,4G,10G --dir /work/scratch

Needs root for drop_caches (without it the runs are warm and say so).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

from expertfs.units import fmt_bytes, parse_size

BIN = os.path.join(os.path.dirname(sys.executable), "expertfs")


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a command and its children."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {status}")
    return dt, ru.ru_maxrss * 1024


def run_size(size: int, like: str, d: str, repeats: int) -> dict:
    model = os.path.join(d, f"bench-{size >> 20}M.gguf")
    if not os.path.exists(model):
        subprocess.run([BIN, "synth", "--like", like, "--size", str(size), "-o", model],
                       check=True, stdout=subprocess.DEVNULL)
    real = os.path.getsize(model)
    copy, store = model + ".copy", model + ".efs"
    rows = []
    for _ in range(repeats):
        for path in (copy, store):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else \
                (os.path.exists(path) and os.unlink(path))
        cold = drop_caches()
        cp, _ = timed(["cp", model, copy])
        t0 = time.perf_counter()
        subprocess.run(["sync"], check=True)
        cp_sync = cp + (time.perf_counter() - t0)
        os.unlink(copy)
        drop_caches()
        rp, rss = timed([BIN, "repack", model, "-o", store, "--json"])
        shutil.rmtree(store)
        rows.append({"cp_s": cp, "cp_sync_s": cp_sync, "repack_s": rp, "repack_rss": rss, "cold": cold})
    best = min(rows, key=lambda r: r["repack_s"])
    return {"model_bytes": real, "runs": rows,
            "repack_over_cp_sync": [r["repack_s"] / r["cp_sync_s"] for r in rows],
            "repack_over_cp": [r["repack_s"] / r["cp_s"] for r in rows],
            "peak_rss": max(r["repack_rss"] for r in rows), "best": best}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1G,4G", help="model sizes, e.g. 1G,4G,10G")
    ap.add_argument("--like", default="qwen3-30b-a3b", help="synth preset for the geometry")
    ap.add_argument("--dir", default=".", help="where models, copies and stores go (one disk)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the synthesised models")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    results = {}
    for s in a.sizes.split(","):
        size = parse_size(s)
        results[s] = run_size(size, a.like, a.dir, a.repeats)
        if not a.keep:
            os.unlink(os.path.join(a.dir, f"bench-{size >> 20}M.gguf"))
    if a.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return 0
    print(f"{'model':>10} {'cp':>8} {'cp+sync':>8} {'repack':>8} {'repack/cp+sync':>15} "
          f"{'repack/cp':>10} {'peak RSS':>10}")
    for s, r in results.items():
        for run in r["runs"]:
            print(f"{fmt_bytes(r['model_bytes']):>10} {run['cp_s']:8.2f} {run['cp_sync_s']:8.2f} "
                  f"{run['repack_s']:8.2f} {run['repack_s'] / run['cp_sync_s']:15.2f} "
                  f"{run['repack_s'] / run['cp_s']:10.2f} {fmt_bytes(run['repack_rss']):>10}"
                  + ("" if run["cold"] else "  (warm: no drop_caches)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
