#!/usr/bin/env python3
"""MKL against oneDNN for the float32 products (``runtime.kernels.gemm``), in one process.

Without a store: float32 products of the shapes prefill, verify passes and float weights
give (tokens × [out, in]), each library's median wall time, alternating rep by rep. With a
store: its resident prefill (every expert in the RAM tier, read before timing) and decode with
the two libraries alternating round by round, the same random prompt, medians reported.

    .venv/bin/python bench/gemm_ab.py --rounds 9
    .venv/bin/python bench/gemm_ab.py --store STORE.efs --tokens 128 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import torch  # noqa: E402

from expertfs.runtime.kernels import gemm  # noqa: E402

SHAPES = ("2048x2048", "4096x2048", "2048x4096", "512x2048", "768x2048", "2048x768",
          "151936x2048")


def use(name: str) -> None:
    os.environ["EXPERTFS_GEMM"] = name
    gemm.backend.cache_clear()
    assert gemm.backend() == name, f"{name} is not available in this torch"


def products(a: argparse.Namespace) -> None:
    print(f"float32 products, {a.threads} threads, medians of {a.rounds}: ms (GFLOP/s)")
    print(f"  {'tokens x out x in':<22} {'mkl':>18} {'onednn':>18}  mkl/onednn")
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k)
        for m in (int(v) for v in a.product_tokens.split(",")):
            x = torch.randn(m, k)
            times: dict[str, list[float]] = {b: [] for b in gemm.BACKENDS}
            for r in range(a.rounds + 1):
                for b in gemm.BACKENDS if r % 2 == 0 else gemm.BACKENDS[::-1]:
                    use(b)
                    t0 = time.perf_counter()
                    gemm.linear(x, w)
                    if r:                                   # round 0 warms both up
                        times[b].append(time.perf_counter() - t0)
            med = {b: statistics.median(ts) for b, ts in times.items()}
            flops = 2 * m * n * k
            cells = "".join(f" {med[b] * 1e3:9.3f} ({flops / med[b] / 1e9:5.0f})"
                            for b in gemm.BACKENDS)
            print(f"  {f'{m} x {n} x {k}':<22}{cells}  {med['mkl'] / med['onednn']:.2f}x")


def store(a: argparse.Namespace) -> None:
    from expertfs.runtime.engine import Engine
    size = os.path.getsize(os.path.join(a.store, "experts.bin"))
    eng = Engine.open(a.store, provider="tiered", ram_bytes=size + (64 << 20))
    eng.warm()
    ids = torch.randint(100, 1000, (a.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    pre: dict[str, list[float]] = {b: [] for b in gemm.BACKENDS}
    dec: dict[str, list[float]] = {b: [] for b in gemm.BACKENDS}
    for r in range(a.rounds):
        for b in gemm.BACKENDS if r % 2 == 0 else gemm.BACKENDS[::-1]:
            use(b)
            eng.reset()
            t0 = time.perf_counter()
            tok = int(eng.prefill(ids).argmax())
            pre[b].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(a.decode):
                tok = int(eng.decode(tok).argmax())
            dec[b].append((time.perf_counter() - t0) / max(a.decode, 1))
    print(f"{a.store}: {a.tokens}-token prefill, {a.decode} decode steps, {a.threads} threads")
    for b in gemm.BACKENDS:
        print(f"  {b:<7} prefill median {statistics.median(pre[b]):6.2f} s ("
              + ", ".join(f"{t:.2f}" for t in pre[b]) + f")  decode {statistics.median(dec[b]) * 1e3:6.1f}"
              " ms/token (" + ", ".join(f"{t * 1e3:.1f}" for t in dec[b]) + ")")
    print(f"  prefill mkl/onednn {statistics.median(pre['mkl']) / statistics.median(pre['onednn']):.2f}x, "
          f"decode {statistics.median(dec['mkl']) / statistics.median(dec['onednn']):.2f}x")
    eng.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", help="a store to prefill and decode resident (else products only)")
    ap.add_argument("--tokens", type=int, default=128, help="prompt length (--store)")
    ap.add_argument("--decode", type=int, default=16, help="decode steps a round (--store)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="out x in of each product")
    ap.add_argument("--product-tokens", default="1,8,32,128", help="tokens of each product")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with torch.inference_mode():
        store(a) if a.store else products(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
