#!/usr/bin/env python3
"""The trunk under a cap that cannot hold it: streamed (``runtime.model.trunk_stream``, the
default) against the page cache's LRU (``EXPERTFS_TRUNK_STREAM=0``), same store, same caps.

For each cap (GiB: the trunk-short caps are below what ``plan`` needs for the trunk and one
layer's experts; ``expertfs plan STORE --memory-limit X`` says "trunk_evicted" there), the two
alternate ``--rounds`` times, each ``expertfs run`` cold (caches dropped) in a memory cgroup of
the cap, 16 tokens after a 65-token prompt. Reported per run: decode tok/s, time to first
token, the trunk bytes read again per forward (the cgroup's disk reads less the experts' and one
load of trunk.bin, over the forwards), what the stream settled on (the deficit it measured and
the bytes it reads a token) and the peak. Needs root (cgroups, drop_caches).

    sudo .venv/bin/python bench/trunk_stream_ab.py STORE --caps 2.6,2.4,2.2 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_lowram import long_prompt  # noqa: E402
from lowram import block_device_of, run_capped  # noqa: E402

BIN = os.path.join(os.path.dirname(sys.executable), "expertfs")
VARIANTS = {"stream": "1", "lru": "0"}


def one(store: str, prompt: str, cap_gib: float, variant: str, n: int) -> dict:
    argv = [BIN, "run", store, "-p", prompt, "-n", str(n), "--ignore-eos", "--temp", "1.0",
            "--ctx", "512", "-t", "2", "--json"]
    env = dict(os.environ, EXPERTFS_TRUNK_STREAM=VARIANTS[variant])
    out = run_capped(argv, int(cap_gib * (1 << 30)), block_device_of(store), timeout=1800, env=env)
    if out.returncode:
        return {"cap_gib": cap_gib, "variant": variant, "failed": out.returncode,
                "stderr": out.stderr[-400:]}
    d = json.loads(out.stdout[out.stdout.index("{"):])
    experts = d["stats"]["provider_stats"]["bytes_read"]
    trunk = os.path.getsize(os.path.join(store, "trunk.bin"))
    ts = d["stats"].get("trunk_stream") or {}
    return {"cap_gib": cap_gib, "variant": variant, "decode_tok_s": d["decode_tokens_per_s"],
            "ttft_s": d["time_to_first_token_s"],
            "trunk_reread_mib": (out.disk_read - experts - trunk) / d["generated_tokens"] / 2**20,
            "stream_deficit_mib": ts.get("deficit_bytes", 0) / 2**20,
            "stream_mib": ts.get("bytes", 0) / 2**20, "peak_gib": out.peak_bytes / 2**30}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--caps", default="2.6,2.4,2.2", help="GiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    prompt = long_prompt(a.store, 64)
    rows = []
    for cap in (float(c) for c in a.caps.split(",")):
        for r in range(a.rounds):
            for v in (("lru", "stream") if r % 2 == 0 else ("stream", "lru")):
                rows.append(one(a.store, prompt, cap, v, a.n))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'cap GiB':>7s} {'LRU tok/s':>10s} {'stream tok/s':>12s} {'ratio':>6s} "
          f"{'LRU re-read':>12s} {'stream re-read':>14s} {'measured deficit':>16s}")
    for cap in dict.fromkeys(r["cap_gib"] for r in rows):
        got = {v: [r for r in rows if r["cap_gib"] == cap and r["variant"] == v
                   and "failed" not in r] for v in VARIANTS}
        if not all(got.values()):
            print(f"{cap:7.2f} failed runs: see stderr")
            continue
        med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "variant"}
               for v, rs in got.items()}
        s, lru = med["stream"], med["lru"]
        print(f"{cap:7.2f} {lru['decode_tok_s']:10.2f} {s['decode_tok_s']:12.2f} "
              f"{s['decode_tok_s'] / lru['decode_tok_s']:5.2f}x {lru['trunk_reread_mib']:8.0f} MiB "
              f"{s['trunk_reread_mib']:10.0f} MiB {s['stream_deficit_mib']:12.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
