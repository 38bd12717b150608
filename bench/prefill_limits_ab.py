#!/usr/bin/env python3
"""Resident prefill with and without the per-ISA native token limits, in one process.

``runtime.kernels.max_tokens`` says how many tokens one native product takes before a product
goes through ``wide_linear`` (dequantize + F.linear) instead. The AVX2 tables
(``WIDE_TYPES_AVX2``, ``WIDE_TYPES_Q8_AVX2``) were measured with ``bench_kernels.py --prefill``;
this puts them against the flat default (``qmatvec.NATIVE_MAX_TOKENS``) that AVX2 had before,
on a whole prompt: the store resident (every expert in the RAM tier, read before timing), the
same random prompt, the two settings alternating round by round, medians reported.

    .venv/bin/python bench/prefill_limits_ab.py STORE.efs --tokens 128 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--tokens", type=int, default=128, help="prompt length")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each setting")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertfs.runtime.engine import Engine
    from expertfs.runtime.kernels import ops
    size = os.path.getsize(os.path.join(a.store, "experts.bin"))
    eng = Engine.open(a.store, provider="tiered", ram_bytes=size + (64 << 20))
    eng.warm()
    ids = torch.randint(100, 1000, (a.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    tables = {"per-ISA limits": dict(ops._WIDE),
              "flat default under AVX2": {k: v for k, v in ops._WIDE.items() if k[0] != "avx2"}}
    times: dict[str, list[float]] = {k: [] for k in tables}
    names = list(tables)
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            ops._WIDE.clear()
            ops._WIDE.update(tables[name])
            eng.reset()
            t0 = time.perf_counter()
            eng.prefill(ids)
            times[name].append(time.perf_counter() - t0)
    ops._WIDE.clear()
    ops._WIDE.update(tables[names[0]])
    isa = ops.load().info()["isa"]
    print(f"{a.store}: {a.tokens}-token prefill, {a.threads} threads, kernels {isa}")
    for name, ts in times.items():
        print(f"  {name:<26} median {statistics.median(ts):7.2f} s  rounds "
              + ", ".join(f"{t:.2f}" for t in ts))
    print(f"  flat / per-ISA: {statistics.median(times[names[1]]) / statistics.median(times[names[0]]):.2f}x")
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
