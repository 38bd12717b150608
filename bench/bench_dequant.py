"""Micro benchmark of the torch dequant kernels and the fused ``linear`` (a plain script).

    python bench/bench_dequant.py                      # all types, 1536x4096, both tables
    python bench/bench_dequant.py --types Q4_K,MXFP4 --threads 1
    python bench/bench_dequant.py --malloc-tuned       # rerun with glibc's trimming off

Table 1, per type: gguf-py numpy ``dequantize`` (the reference, 30-130 ms a matrix) against
``expertfs.formats.dequant.dequantize`` for one expert-sized matrix; MB/s counts quantized
bytes in. Table 2, per type, shape and batch: ``F.linear`` on a float32 weight already in
memory (the floor), numpy dequant + ``F.linear``, ``dequantize`` + ``F.linear`` (plain), and
``linear`` (chunked, fused), in microseconds per matrix.

Timings are the minimum over interleaved rounds (every torch candidate once per round), so a
noisy shared machine affects them alike; compare ratios within one run. The numpy reference
runs in its own rounds first: its 100 MB temporaries change glibc's heap state, and torch
timed right after them pays page faults that belong to numpy.

``--malloc-tuned`` re-runs the script with ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` raised: glibc otherwise returns freed multi-MB temporaries to the
kernel and page-faults them back on the next call, which on a VM costs up to 1-3 ms per
matrix for the IQ types.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

import numpy as np
import torch
import torch.nn.functional as F
from gguf import quants as gq

from expertfs.formats.dequant import SUPPORTED_TYPES, dequantize, linear
from expertfs.formats.ggml import GGMLType, block_size, row_bytes, type_size

F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}
FUSED_TYPES = ("Q8_0", "Q4_K", "MXFP4", "IQ2_XXS")
TUNED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 28), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def weight_bytes(t: GGMLType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with moderate finite scales (|d| < 1, MXFP4 exponents near 1)."""
    if t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if t == GGMLType.F32:
            return w.view(np.uint8)
        return gq.quantize(w, t).view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, (rows * cols // block_size(t), type_size(t)), dtype=np.uint8)
    for off in F16_FIELDS.get(t.name, ()):
        d = rng.uniform(-1, 1, (len(blocks), 1)).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8)
    if t == GGMLType.MXFP4:
        blocks[:, 0] = rng.integers(118, 136, len(blocks), dtype=np.uint8)
    if t == GGMLType.IQ1_M:
        blocks[:, 55] &= 0xBF
    return blocks.reshape(rows, row_bytes(t, cols))


CLOCK = time.perf_counter


def race(candidates: dict, rounds: int) -> dict[str, float]:
    """Minimum time (s) of each candidate over interleaved rounds, after one warm-up."""
    for fn in candidates.values():
        fn()
    best = {k: float("inf") for k in candidates}
    for _ in range(rounds):
        for k, fn in candidates.items():
            t0 = CLOCK()
            fn()
            best[k] = min(best[k], CLOCK() - t0)
    return best


def numpy_dequant(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return gq.dequantize(raw, t)


def table_dequant(types: list[GGMLType], rows: int, cols: int, rounds: int) -> None:
    rng = np.random.default_rng(0)
    print(f"\n## dequantize one {rows}x{cols} matrix "
          f"(torch threads={torch.get_num_threads()}, best of {rounds})\n")
    print("| type | bytes | numpy gguf ms | torch ms | torch MB/s | Melem/s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for t in types:
        raw = weight_bytes(t, rows, cols, rng)
        traw = torch.from_numpy(raw)
        tn = race({"numpy": lambda: numpy_dequant(raw, t)}, max(2, rounds // 2))["numpy"]
        tt = race({"torch": lambda: dequantize(traw, t, (rows, cols))}, rounds)["torch"]
        print(f"| {t.name} | {raw.nbytes} | {tn * 1e3:.1f} | {tt * 1e3:.2f} | "
              f"{raw.nbytes / tt / 1e6:.0f} | {rows * cols / tt / 1e6:.0f} | {tn / tt:.0f}x |")


def table_fused(types: list[GGMLType], rounds: int, batches: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    print(f"\n## F.linear from quantized bytes, µs per matrix "
          f"(torch threads={torch.get_num_threads()}, best of {rounds})\n")
    print("| type | out x in | batch | f32 W in RAM | numpy dq + linear | dequantize + linear "
          "| fused linear | fused vs plain | fused MB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for t in types:
        for rows, cols in ((1536, 4096), (4096, 1536)):
            raw = weight_bytes(t, rows, cols, rng)
            traw = torch.from_numpy(raw)
            w = dequantize(traw, t, (rows, cols))
            for b in batches:
                x = torch.randn(b, cols)
                r = race({"numpy": lambda: F.linear(x, torch.from_numpy(numpy_dequant(raw, t)))},
                         max(2, rounds // 2))
                r.update(race({
                    "floor": lambda: F.linear(x, w),
                    "plain": lambda: F.linear(x, dequantize(traw, t, (rows, cols))),
                    "fused": lambda: linear(x, traw, t, (rows, cols)),
                }, rounds))
                print(f"| {t.name} | {rows}x{cols} | {b} | {r['floor'] * 1e6:.0f} | "
                      f"{r['numpy'] * 1e6:.0f} | {r['plain'] * 1e6:.0f} | {r['fused'] * 1e6:.0f} | "
                      f"{r['plain'] / r['fused']:.2f}x | {raw.nbytes / r['fused'] / 1e6:.0f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="", help="comma-separated ggml type names (default all)")
    ap.add_argument("--fused-types", default=",".join(FUSED_TYPES))
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time, steadier on a shared machine "
                         "(use with --threads 1)")
    ap.add_argument("--skip-dequant", action="store_true")
    ap.add_argument("--skip-fused", action="store_true")
    ap.add_argument("--malloc-tuned", action="store_true",
                    help="re-run with glibc mmap/trim thresholds raised (see the docstring)")
    args = ap.parse_args(argv)
    if args.malloc_tuned and any(os.environ.get(k) != v for k, v in TUNED_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TUNED_ENV})
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    names = [s for s in args.types.split(",") if s]
    types = ([GGMLType[s.upper()] for s in names] if names
             else sorted(SUPPORTED_TYPES, key=int))
    tuned = all(os.environ.get(k) == v for k, v in TUNED_ENV.items())
    print(f"# expertfs dequant bench: torch {torch.__version__}, "
          f"glibc malloc {'tuned' if tuned else 'default'}, {args.clock} clock")
    if not args.skip_dequant:
        table_dequant(types, args.rows, args.cols, args.rounds)
    if not args.skip_fused:
        fused = [GGMLType[s.upper()] for s in args.fused_types.split(",") if s]
        table_fused(fused, args.rounds, (1, 16))


if __name__ == "__main__":
    main()
