#!/usr/bin/env python3
"""The panel product (``kernels.qgemm``) against the two ways a many-token product from ggml
bytes can go without it, alternating rep by rep in one process (medians of ``--rounds``):

- ``qgemm``: each 24-row panel dequantized into the core's cache, multiplied by every token
  (on a CPU with AMX-BF16, the types ``qgemm_amx.cpp`` takes run on the tile unit);
- ``float panel``: on such a CPU, ``qgemm`` with AMX off (``kernels.without_amx``);
- ``exact rows``: the exact row kernels over all the tokens (what a batch below the type's
  ``max_tokens`` takes);
- ``dequant+gemm``: ``wide.dequant_linear``, ``wide_linear``'s path without it: the rows
  dequantized into a reused 4 MiB buffer and multiplied by the box's GEMM library
  (``kernels.gemm.linear``: oneDNN or MKL);
- ``float gemm``: the same library on weights already in float32 (no dequantization at all:
  the float32 arithmetic's own speed on this box, the ceiling of an exact product);
- ``qgemm q8``: the panel product in q8 numerics (``act_quant="q8"``: the 8-bit integer panel
  where the CPU has AVX512-VNNI or AVX-VNNI and the type one, else the exact panel);
- ``q8 rows``: the q8 row kernels over all the tokens (what q8 took before its panel).

    .venv/bin/python bench/qgemm_ab.py [--types q4_k,q6_k,q8_0] [--tokens 16,32,64,131]
        [--isa avx2]   # with EXPERTFS_GEMM=mkl on an AMD CPU: an AVX2 box's products
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_kernels import weight  # noqa: E402  (bench/, the script's own folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q4_k,q6_k,q8_0")
    ap.add_argument("--shapes", default="768x2048,2048x768,4096x2048,2048x4096")
    ap.add_argument("--tokens", default="16,32,64,131")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--isa", choices=("avx2", "avx512"), help="the kernels' ISA (default: best)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertfs.formats.ggml import GGMLType
    from expertfs.runtime import kernels
    from expertfs.runtime.kernels import gemm
    from expertfs.runtime.model.wide import dequant_linear
    mod = kernels.load()
    if mod is None:
        raise SystemExit(f"native kernels unavailable: {kernels.status()['reason']}")
    if a.isa:
        mod.set_isa(a.isa)

    print(f"ms per product (GFLOP/s), medians of {a.rounds} alternating reps, {a.threads} "
          f"thread(s), kernels {mod.info()['isa']}, GEMM {gemm.backend()}")
    amx = bool(mod.info().get("amx"))
    print(f"  {'type':6s} {'tokens x out x in':>20s} {'qgemm':>16s} {'dequant+gemm':>16s} "
          f"{'float gemm':>16s} {'qgemm q8':>16s} {'q8 rows':>16s} {'exact rows':>16s}"
          + (f"{'float panel':>16s}" if amx else "") + f"{'(dequant+gemm)/qgemm':>21s}")

    def float_panel(f):
        with kernels.without_amx():
            return f()
    for name in a.types.split(","):
        t = GGMLType[name.upper()]
        for shape in a.shapes.split(","):
            rows, cols = (int(v) for v in shape.split("x"))
            raw = weight(t, rows, cols, 1)
            W = kernels.dequant(raw, t, (rows, cols))
            for nt in (int(v) for v in a.tokens.split(",")):
                x = torch.randn(nt, cols)
                ways = {"qgemm": lambda: kernels.qgemm(x, raw, t, (rows, cols)),
                        "dequant+gemm": lambda: dequant_linear(x, raw, t, (rows, cols)),
                        "float gemm": lambda: gemm.linear(x, W),
                        "qgemm q8": lambda: kernels.qgemm(x, raw, t, (rows, cols), "q8"),
                        "q8 rows": lambda: kernels.matvec(x, raw, t, (rows, cols), "q8"),
                        "exact rows": lambda: kernels.matvec(x, raw, t, (rows, cols))}
                if amx:
                    ways["float panel"] = lambda: float_panel(
                        lambda: kernels.qgemm(x, raw, t, (rows, cols)))
                times: dict[str, list[float]] = {k: [] for k in ways}
                for f in ways.values():                  # warm-up (oneDNN compiles a shape)
                    f()
                for _ in range(a.rounds):
                    for k, f in ways.items():
                        t0 = time.perf_counter()
                        f()
                        times[k].append(time.perf_counter() - t0)
                med = {k: statistics.median(v) for k, v in times.items()}
                fl = 2 * nt * rows * cols
                cells = "".join(f"{med[k] * 1e3:9.2f} ({fl / med[k] / 1e9:4.0f})" for k in ways)
                print(f"  {name:6s} {f'{nt} x {rows} x {cols}':>20s}{cells}"
                      f"{med['dequant+gemm'] / med['qgemm']:21.2f}", flush=True)


if __name__ == "__main__":
    main()
