#!/usr/bin/env python3
"""How long the native kernels' idle pool workers spin before sleeping (``kernels.set_spin_us``,
``csrc/pool.h``), against decode time: one process, the store opened once with a RAM tier of
``--ram`` GiB (default: every expert, the resident case; less: a cap's tier, its misses read
with O_DIRECT), then the same seeded prompt and decode steps timed under each spin setting in
alternating rounds (``decode_products.timed_decode``). A longer spin catches the next call of a
decode step without a wake-up, and takes the core the I/O threads (reads' completions,
checksums) need while the forward pass waits for them.

    .venv/bin/python bench/pool_spin_ab.py STORE.efs --spins 50,500 --rounds 10
    .venv/bin/python bench/pool_spin_ab.py STORE.efs --ram 0.6 --spins 50,500 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics

from decode_products import timed_decode

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--ram", type=float, default=None, help="RAM tier GiB (default: every expert)")
    ap.add_argument("--spins", default="50,500", help="microseconds, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-n", type=int, default=48, help="decode steps a round")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertfs.runtime import kernels
    from expertfs.runtime.engine import Engine
    every = os.path.getsize(os.path.join(a.store, "experts.bin")) + (64 << 20)
    ram = every if a.ram is None else int(a.ram * 2**30)
    eng = Engine.open(a.store, provider="tiered", ram_bytes=ram,
                      provider_options={"backend": "direct"})
    if a.ram is None:
        eng.warm()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 1000, (16,), generator=g).tolist()
    steps = torch.randint(1, 1000, (a.n,), generator=g).tolist()
    timed_decode(eng, prompt, steps[:8])                     # warm-up
    spins = [int(s) for s in a.spins.split(",")]
    ms: dict[int, list[float]] = {s: [] for s in spins}
    for r in range(a.rounds):
        for s in (spins if r % 2 == 0 else spins[::-1]):
            kernels.set_spin_us(s)
            ms[s].append(timed_decode(eng, prompt, steps) / a.n * 1e3)
    for s, v in ms.items():
        print(f"spin {s:5d} us: median {statistics.median(v):.2f} ms a token; rounds "
              + " ".join(f"{x:.1f}" for x in v))
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
