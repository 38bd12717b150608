#!/usr/bin/env python3
"""Two builds of the native kernels in one process, product by product: each matrix's
products alternate between the builds round by round, so the box's drift falls on both alike.

``--before`` is the folder of an earlier build (``~/.cache/expertfs/kernels/expertfs_kernels_*``:
check out the earlier sources and import ``expertfs.runtime.kernels`` once to build it); the
working tree's build is the other. Weights are random valid blocks, hot in the cache after the
first call, or with ``--cold MB`` that many MiB of copies taken in turn, so each product reads
its weights from memory as a decode step does (past the last-level cache; for prefetch
changes); the figure per shape is the median over ``--rounds`` of each build's G weights/s
(rows x cols / seconds a product, whatever the token count).

    .venv/bin/python bench/kernel_build_ab.py --before ~/.cache/expertfs/kernels/X \\
        --types q4_k,q6_k,q8_0 --tokens 1,4 -t 1 [--qgemm]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import time
from types import ModuleType

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import numpy as np  # noqa: E402
import torch  # noqa: E402


def load_build(folder: str) -> ModuleType:
    """The kernel extension built in ``folder``, configured as ``build.load`` configures its
    own (the IQ tables, the CPU)."""
    from expertfs.runtime.kernels import build
    so = glob.glob(os.path.join(folder, "*.so"))[0]
    spec = importlib.util.spec_from_file_location(os.path.basename(so).split(".")[0], so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    build.configure(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="folder of the earlier build")
    ap.add_argument("--types", default="q4_k,q6_k", help="ggml types, comma-separated")
    ap.add_argument("--shapes", default="4096x2048,2048x768", help="ROWSxCOLS, comma-separated")
    ap.add_argument("--tokens", default="1", help="activation rows, comma-separated")
    ap.add_argument("--act-quant", default="off", choices=("off", "q8"))
    ap.add_argument("--qgemm", action="store_true",
                    help="time the panel product (qgemm) instead of the row kernels (matvec)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--isa", default="best", help="both builds' kernels held to this ISA "
                    "(set_isa: best, avx512, avx2, scalar)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cold", type=int, default=0, metavar="MB",
                    help="rotate over this many MiB of copies of each matrix (0: one, hot)")
    a = ap.parse_args()
    from expertfs.formats.ggml import GGMLType, block_size
    from expertfs.formats.random_blocks import make_blocks
    from expertfs.runtime.kernels import build
    torch.set_num_threads(a.threads)
    after, before = build.load(), load_build(a.before)
    for m in (before, after):
        m.set_threads(a.threads)
        m.set_isa(a.isa)
    mode = 0 if a.act_quant == "off" else 1
    fn = "qgemm" if a.qgemm else "matvec"
    rng = np.random.default_rng(0)
    for name in a.types.split(","):
        t = GGMLType[name.upper()]
        for shape in a.shapes.split(","):
            rows, cols = (int(v) for v in shape.split("x"))
            if cols % block_size(t):
                continue
            blocks = make_blocks(t, rows * cols // block_size(t), 0.05, rng)
            raw = torch.from_numpy(blocks.reshape(-1).copy()).view(torch.uint8)
            raws = [raw] + [raw.clone() for _ in range((a.cold << 20) // raw.numel())]
            for nt in (int(v) for v in a.tokens.split(",")):
                x = torch.randn(nt, cols)
                n = max(3, int(3e8 / (rows * cols)), len(raws))
                res: dict[str, list[float]] = {"before": [], "after": []}
                for _ in range(a.rounds):
                    for tag, m in (("before", before), ("after", after)):
                        f = getattr(m, fn)
                        f(x, raw, int(t), rows, cols, mode)
                        t0 = time.perf_counter()
                        for i in range(n):
                            f(x, raws[i % len(raws)], int(t), rows, cols, mode)
                        res[tag].append(rows * cols * n / (time.perf_counter() - t0) / 1e9)
                b, f = (statistics.median(res[k]) for k in ("before", "after"))
                print(f"{t.name:8s} {rows}x{cols} tokens {nt}: before {b:6.2f}, after {f:6.2f} "
                      f"G weights/s (after/before {f / b:.3f})", flush=True)


if __name__ == "__main__":
    main()
