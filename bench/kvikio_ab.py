#!/usr/bin/env python3
"""kvikio's host path against the POSIX backends, interleaved, cold: does kvikio's POSIX
compat path do better reading with O_DIRECT (``auto_direct_io_read``, our default) or through
the page cache, and how close is it to the best of ``direct`` and ``buffered``?

    sudo .venv/bin/python bench/kvikio_ab.py FILE [--qd 1,4,16] [--rounds 3] [--reads 200]

Every (round, queue depth) point reads the same random 4 MiB sample with each arm in turn (the
order rotated each round), the page cache dropped before each; the table gives per-arm medians over rounds in GB/s and kvikio's
ratio to the best POSIX backend. Needs kvikio and libcuda.so.1 (the NVIDIA driver; the tests'
stub driver serves for the host path, see tests/test_io_kvikio.py) and root (drop_caches).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess

import expertfs.runtime  # noqa: F401 - the runtime's OpenMP wait policy before torch loads
from expertfs.runtime.io import bench as B
from expertfs.runtime.io.kvikio_backend import KvikioBackend

ARMS = ("kvikio O_DIRECT", "kvikio buffered", "direct", "buffered")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--qd", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reads", type=int, default=200, help="4 MiB reads per point")
    a = ap.parse_args()
    import kvikio.defaults
    target = B.target_from_file(a.file, 4 << 20)
    rng = random.Random(0)
    res: dict[tuple[int, str], list[float]] = {}
    for rnd in range(a.rounds):
        for qd in (int(q) for q in a.qd.split(",")):
            order = rng.sample(range(len(target.reads)), min(a.reads, len(target.reads)))
            # the arms in a rotated order each round: none always runs first or after another
            for arm in ARMS[rnd % len(ARMS):] + ARMS[:rnd % len(ARMS)]:
                kv = arm.startswith("kvikio")
                if kv:
                    direct = arm.endswith("O_DIRECT")
                    KvikioBackend.__init__.__kwdefaults__["direct_io"] = direct
                    kvikio.defaults.set("auto_direct_io_read", direct)
                subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
                p = B.run_point(target, "kvikio" if kv else arm, qd, order, verify=False)
                res.setdefault((qd, arm), []).append(p.gbps)
    KvikioBackend.__init__.__kwdefaults__["direct_io"] = True
    print(f"{'QD':>3} " + " ".join(f"{arm:>16}" for arm in ARMS) + "  kvikio O_DIRECT / best POSIX")
    for qd in sorted({q for q, _ in res}):
        med = {arm: statistics.median(res[qd, arm]) for arm in ARMS}
        best = max(med["direct"], med["buffered"])
        print(f"{qd:>3} " + " ".join(f"{med[arm]:16.2f}" for arm in ARMS)
              + f"  {med['kvikio O_DIRECT'] / best:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
