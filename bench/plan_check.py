"""``expertfs plan``'s predicted decode tok/s beside ``expertfs run``'s measured tok/s, for a few
synthesised stores and memory caps (``EXPERTFS_MEMORY_LIMIT``, read by both as a cgroup cap).

    .venv/bin/python bench/plan_check.py --dir /work/scratch/plan_check \
        --store 'tiny6:--layers 6 --experts 16 --top-k 4 --vocab 2048 --quant q4_k_m' \
        --store 'q30b4:--like Qwen3-30B-A3B --layers 4 --quant q4_k_m' --caps none,0.5 --rounds 3

Per (store, cap): plan once for a run of ``-n`` tokens (its probes are cached per box; the
first reads into the empty tiers are spread over those tokens), then ``run`` ``--rounds`` times,
rows alternated round by round so a loaded box slows every row alike; the median tok/s is
compared with the predicted range (ratio = measured / the range's geometric midpoint). The
stores are deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

PY = sys.executable


def _ef(*argv: str, env: dict | None = None, timeout: float = 900) -> str:
    r = subprocess.run([PY, "-m", "expertfs", *argv], capture_output=True, text=True, env=env,
                       timeout=timeout)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"expertfs {' '.join(argv)}: {r.stderr[-800:]}")
    return r.stdout


def _env(limit: int | None) -> dict:
    env = dict(os.environ)
    if limit is not None:
        env["EXPERTFS_MEMORY_LIMIT"] = str(limit)
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--store", action="append", required=True, metavar="NAME:SYNTH ARGS")
    ap.add_argument("--caps", default="none,0.5",
                    help="memory caps: none, or a fraction of the store's size")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("-n", type=int, default=48, help="tokens generated per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-probe", action="store_true", help="plan with --no-probe")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    rows = []
    try:
        for spec in a.store:
            name, _, synth = spec.partition(":")
            gguf, store = os.path.join(a.dir, name + ".gguf"), os.path.join(a.dir, name + ".efs")
            if not os.path.isdir(store):
                _ef("synth", "-o", gguf, "--force", *synth.split())
                _ef("repack", gguf, "-o", store)
                os.unlink(gguf)
            size = sum(os.path.getsize(os.path.join(store, f)) for f in os.listdir(store))
            for cap in a.caps.split(","):
                limit = None if cap == "none" else int(float(cap) * size) + (400 << 20)
                plan = json.loads(_ef("plan", store, "--ctx", str(a.ctx), "-n", str(a.n), "--json",
                                      *(["--no-probe"] if a.no_probe else []), env=_env(limit)))
                p = plan.get("prediction") or {}
                rows.append({"store": name, "size": size, "cap": cap, "limit": limit,
                             "low": p.get("tok_s_low"), "high": p.get("tok_s_high"),
                             "dominant": p.get("dominant_slow"), "run": [], "run_args": plan["run"]})
        for _ in range(a.rounds):                           # rows alternated, round by round
            for r in rows:
                store = os.path.join(a.dir, r["store"] + ".efs")
                out = _ef("run", store, "-p", "The quick brown fox", "-n", str(a.n), "--ignore-eos",
                          "--ctx", str(a.ctx), "--json", env=_env(r["limit"]))
                r["run"].append(json.loads(out)["decode_tokens_per_s"])
        load = os.getloadavg()[0]
        print(f"load average at the end: {load:.1f} on {os.cpu_count()} CPUs; medians of {a.rounds}"
              f" runs of {a.n} tokens")
        print(f"{'store':<8} {'GiB':>5} {'cap':>5} {'limit':>9} {'plan tok/s':>17} {'run tok/s':>10}"
              f" {'runs':>24} {'ratio':>6} in?")
        for r in rows:
            med = statistics.median(r["run"])
            lo, hi = r["low"] or 0.0, r["high"] or 0.0
            mid = math.sqrt(lo * hi) if lo and hi else 0.0
            lim = "-" if r["limit"] is None else f"{r['limit'] / 2**30:.2f}G"
            print(f"{r['store']:<8} {r['size'] / 2**30:5.2f} {r['cap']:>5} {lim:>9} "
                  f"{lo:7.2f}-{hi:8.2f} {med:10.2f} {','.join(f'{x:.1f}' for x in r['run']):>24} "
                  f"{med / mid if mid else 0:6.2f} {'yes' if lo <= med <= hi else 'no'}")
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
