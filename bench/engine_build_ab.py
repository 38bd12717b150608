#!/usr/bin/env python3
"""Two builds of the native kernels in one process: the engine's resident decode alternates
between them token by token, so the box's drift falls on both alike.

``--before`` is the folder of an earlier build (``~/.cache/expertfs/kernels/expertfs_kernels_*``:
check out the earlier sources and import ``expertfs.runtime.kernels`` once to build it); the
working tree's build is the other. The store is read into the RAM tier first (``warm()``), a
32-token prompt is run, then ``-n`` decode steps alternate; medians in ms a token. With
``--prefill N``, ``-n`` prompts of N tokens alternate instead (the sequence reset before each).

    .venv/bin/python bench/engine_build_ab.py STORE.efs --before ~/.cache/expertfs/kernels/X -n 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import torch  # noqa: E402
from kernel_build_ab import load_build  # noqa: E402  (bench/, the script's own folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--before", required=True, help="folder of the earlier build")
    ap.add_argument("-n", type=int, default=60, help="decode steps, alternating")
    ap.add_argument("--ram", type=float, default=0, help="RAM tier GiB (0: the store's experts)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="alternate prompts of N tokens instead of decode steps")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertfs.runtime.engine import Engine
    from expertfs.runtime.kernels import build
    ram = int(a.ram * (1 << 30)) or os.path.getsize(os.path.join(a.store, "experts.bin")) + (64 << 20)
    eng = Engine.open(a.store, provider="tiered", ram_bytes=ram)
    eng.warm()
    after = build.load()
    before = load_build(a.before)
    before.set_threads(torch.get_num_threads())
    g = torch.Generator().manual_seed(0)
    eng.prefill(torch.randint(1, 1000, (32,), generator=g).tolist())
    steps = torch.randint(1, 1000, (a.n + 4,), generator=g).tolist()
    for t in steps[:4]:
        eng.decode(t)
    prompt = torch.randint(1, 1000, (a.prefill,), generator=g).tolist()
    res: dict[str, list[float]] = {"before": [], "after": []}
    for i, t in enumerate(steps[4:]):
        tag = "before" if i % 2 == 0 else "after"
        build._state["module"] = before if tag == "before" else after
        if a.prefill:
            eng.reset()
        t0 = time.perf_counter()
        if a.prefill:
            eng.prefill(prompt)
        else:
            eng.decode(t)
        res[tag].append(time.perf_counter() - t0)
    build._state["module"] = after
    b, f = (statistics.median(res[k]) * 1e3 for k in ("before", "after"))
    what = f"ms a {a.prefill}-token prompt" if a.prefill else "ms a token"
    print(f"{a.store}: before {b:.1f} {what}, after {f:.1f} (after/before {f / b:.3f}), "
          f"{a.n} {'prompts' if a.prefill else 'steps'} alternating")


if __name__ == "__main__":
    main()
