#!/usr/bin/env python3
"""Per-expert cost of the decode matrix-vector products: the native kernels (exact and q8)
against the torch paths, for expert-shaped matrices of each ggml type.

For each type, one expert's matrices (gate and up ``n_ff × n_embd``, down ``n_embd × n_ff``) are
multiplied by one token through:

- ``native``: ``runtime.kernels`` in its exact mode (the default); ``native-q8``: the opt-in
  llama.cpp activation quantization;
- ``compiled``: the ``torch.compile`` expression of ``runtime.model.qmatvec`` (the fallback
  without a C++ toolchain; its types only);
- ``eager``: ``dequant.linear`` (dequantize in chunks, then ``F.linear``);
- ``f32``: ``F.linear`` on the already dequantized float32 weight (what the dequant cache buys
  with ~7x the RAM of Q4).

Then the per-layer call: ``--experts`` experts through ``kernels.moe`` in one call, each time a
different random selection out of ``--pool`` experts per layer (weights cold in the caches, as in
decode), reported per expert. One thread: CPU time of the thread (robust on a shared machine);
more threads: wall time, best of ``--rounds``.

``speed-up`` is eager / native: what the native exact kernel gains over dequantize + F.linear.

``--isa-compare``: instead, each type's native products (exact and q8) on every vector ISA this
CPU runs (avx2, avx512: ``kernels.set_isa``), per ``--shapes`` (rows x cols) and ``--tokens``,
the ISAs alternating round by round; µs per product and avx2 / avx512.

    .venv/bin/python bench/bench_kernels.py [-t 1] [--types q4_k,q6_k] [--layer iq2_xxs,iq2_xxs,iq2_s]
        [--json]
    .venv/bin/python bench/bench_kernels.py --isa-compare -t 2 --types iq2_xxs,iq2_s
        [--shapes 2048x4096,4096x2048] [--tokens 1,8]

``--prefill``: instead, per type, ``--shapes`` and ``--tokens`` (defaults: the expert and trunk
shapes at 32 to 256 tokens), the native product (exact, and q8) against ``wide_linear``
(the panel product, what products wider than ``kernels.max_tokens`` take: exact, and in q8
numerics, the integer one where the CPU has AVX512-VNNI), alternating round by round, best of
``--rounds``: CPU time of the process (every thread's; robust on a shared machine) and wall
time. ``ratio`` = wide / native exact, ``q8 ratio`` = wide-q8 / native-q8 (above 1: the native
product wins); ``max_tokens`` is what ``kernels.max_tokens`` says for the type.

    .venv/bin/python bench/bench_kernels.py --prefill -t 2 --types q4_k,q6_k [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

# before torch loads: the runtime's OpenMP wait policy, as the CLI sets it
from expertfs.runtime.openmp import configure  # noqa: E402,I001

configure()

import expertfs.runtime  # noqa: F401,I001 - its OpenMP wait policy must be set before torch loads

import numpy as np
import torch

from expertfs.formats.ggml import GGMLType, block_size
from expertfs.formats.random_blocks import make_blocks

DEFAULT_TYPES = ("q4_k", "q6_k", "q5_k", "q8_0", "q4_0", "q2_k", "q3_k", "iq4_xs", "mxfp4",
                 "q5_0", "q5_1", "q4_1", "bf16", "f16", "iq4_nl", "iq2_xxs", "iq2_s", "iq3_xxs",
                 "iq2_xs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0")


def weight(t: GGMLType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid ggml bytes of a ``rows × cols`` matrix (synth's blocks: gguf-py's quantization
    where it can, random valid blocks with sane scales otherwise)."""
    rng = np.random.default_rng(seed)
    if t in (GGMLType.TQ1_0, GGMLType.TQ2_0):       # synth has no TQ: gguf-py quantizes them
        from gguf import quants
        w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(quants.quantize(w, t)).reshape(-1))
    n = rows * cols // block_size(t)
    return torch.from_numpy(make_blocks(t, n, 0.02, rng).reshape(-1))


def timer(threads: int):
    return time.thread_time if threads == 1 else time.perf_counter


def best_us(f, threads: int, n: int, rounds: int) -> float:
    clk = timer(threads)
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = clk()
        for _ in range(n):
            f()
        best = min(best, (clk() - t0) / n)
    return best * 1e6


def per_type(t: GGMLType, D: int, ff: int, threads: int, rounds: int) -> dict:
    from expertfs.formats.dequant import dequantize, linear
    from expertfs.runtime import kernels
    from expertfs.runtime.model import qmatvec
    mats = [(weight(t, ff, D, 1), (ff, D)), (weight(t, ff, D, 2), (ff, D)),
            (weight(t, D, ff, 3), (D, ff))]
    xs = {D: torch.randn(1, D), ff: torch.randn(1, ff)}
    n = max(5, int(2e7 / (3 * D * ff)))
    out: dict = {}

    def expert(fn):
        return lambda: [fn(xs[sh[1]], raw, sh) for raw, sh in mats]

    out["native"] = best_us(expert(lambda x, r, s: kernels.matvec(x, r, t, s)), threads, n,
                            rounds)
    out["native-q8"] = best_us(expert(lambda x, r, s: kernels.matvec(x, r, t, s, "q8")),
                               threads, n, rounds)
    if t in qmatvec.SUPPORTED:
        try:
            comp = {s: torch.compile(qmatvec._KERNELS[t], dynamic=False, fullgraph=True)
                    for _, s in mats}
            with torch.inference_mode():
                out["compiled"] = best_us(expert(lambda x, r, s: comp[s](
                    r.reshape(s[0], -1), x.reshape(-1))), threads, n, rounds)
        except Exception as e:  # noqa: BLE001 - no toolchain: the row says so
            out["compiled"] = f"unavailable ({type(e).__name__})"
    out["eager"] = best_us(expert(lambda x, r, s: linear(x, r, t, s)), threads,
                           max(2, n // 10), rounds)
    fw = {id(r): dequantize(r, t, s) for r, s in mats}
    out["f32"] = best_us(expert(lambda x, r, s: torch.nn.functional.linear(x, fw[id(r)])),
                         threads, n, rounds)
    return out


def layer(types: tuple[GGMLType, GGMLType, GGMLType], D: int, ff: int, k: int, pool: int,
          threads: int, rounds: int) -> dict:
    from expertfs.runtime import kernels
    tg, tu, td = types
    base = [weight(tg, ff, D, 11), weight(tu, ff, D, 12), weight(td, D, ff, 13)]
    experts = [[b.clone() for b in base] for _ in range(pool)]
    x, w = torch.randn(1, D), torch.rand(k)
    rng = random.Random(0)
    sel = [rng.sample(range(pool), k) for _ in range(64)]
    out = {}
    for aq in ("off", "q8"):
        i = [0]

        def step() -> None:
            s = sel[i[0] % len(sel)]
            i[0] += 1
            kernels.moe(x, w, [experts[j][0] for j in s], [experts[j][1] for j in s],
                        [experts[j][2] for j in s], types, ff, aq)
        out["exact" if aq == "off" else "q8"] = best_us(step, threads, len(sel), rounds) / k
    return out


def isa_compare(types: list[GGMLType], shapes: list[tuple[int, int]], tokens: list[int],
                threads: int, rounds: int) -> dict:
    """{type: {"RxC/nt": {"exact"|"q8": {isa: µs}}}} for the vector ISAs of this CPU."""
    from expertfs.runtime import kernels
    mod = kernels.load()
    isas = {"avx2": ["avx2"], "avx512": ["avx2", "avx512"]}.get(mod.info()["best_isa"], [])
    clk, out = timer(threads), {}
    try:
        for t in types:
            for rows, cols in shapes:
                raw = weight(t, rows, cols, 1)
                for nt in tokens:
                    x = torch.randn(nt, cols)
                    n = max(3, int(4e7 / (rows * cols * nt)))
                    cell = out.setdefault(t.name, {}).setdefault(f"{rows}x{cols}/{nt}", {})
                    for aq in ("off", "q8"):
                        res = cell.setdefault("exact" if aq == "off" else "q8", {})
                        for name in isas:               # warm-up
                            mod.set_isa(name)
                            kernels.matvec(x, raw, t, (rows, cols), aq)
                        for _ in range(rounds):
                            for name in isas:
                                mod.set_isa(name)
                                t0 = clk()
                                for _ in range(n):
                                    kernels.matvec(x, raw, t, (rows, cols), aq)
                                us = (clk() - t0) / n * 1e6
                                res[name] = min(res.get(name, float("inf")), us)
    finally:
        mod.set_isa("best")
    return out


PREFILL_SHAPES = "768x2048,2048x768,2048x4096,4096x2048,512x2048"
PREFILL_TOKENS = "32,64,128,256"


def prefill(types: list[GGMLType], shapes: list[tuple[int, int]], tokens: list[int],
            rounds: int) -> dict:
    """{type: {"RxC/nt": {"native"|"native-q8"|"wide"|"wide-q8": (cpu µs, wall µs)}}}, best of
    rounds; "wide-q8" is ``wide_linear`` in q8 numerics (the integer panel product where the CPU
    has AVX512-VNNI and the type one, else the exact one)."""
    from expertfs.runtime import kernels
    from expertfs.runtime.model.wide import wide_linear
    out: dict = {}
    for t in types:
        for rows, cols in shapes:
            raw = weight(t, rows, cols, 1)
            for nt in tokens:
                x = torch.randn(nt, cols)
                n = max(1, int(2e8 / (rows * cols * nt)))
                fns = {"native": lambda: kernels.matvec(x, raw, t, (rows, cols)),
                       "native-q8": lambda: kernels.matvec(x, raw, t, (rows, cols), "q8"),
                       "wide": lambda: wide_linear(x, raw, t, (rows, cols)),
                       "wide-q8": lambda: wide_linear(x, raw, t, (rows, cols), act_quant="q8")}
                cell = out.setdefault(t.name, {}).setdefault(f"{rows}x{cols}/{nt}", {})
                for f in fns.values():                  # warm-up
                    f()
                for _ in range(rounds):
                    for name, f in fns.items():
                        c0, w0 = time.process_time(), time.perf_counter()
                        for _ in range(n):
                            f()
                        c, w = (time.process_time() - c0) / n, (time.perf_counter() - w0) / n
                        old = cell.get(name, (float("inf"), float("inf")))
                        cell[name] = (min(old[0], c * 1e6), min(old[1], w * 1e6))
    return out


def print_prefill(res: dict, threads: int) -> None:
    from expertfs.runtime import kernels
    print(f"µs per product, best of rounds, {threads} thread(s), CPU time of the process (wall "
          f"in brackets); ratio = wide / native, q8 ratio = wide-q8 / native-q8 (CPU, wall); "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  {'type':8s} {'shape/tokens':>16s} {'native':>16s} {'native-q8':>16s} "
          f"{'wide':>16s} {'wide-q8':>16s} {'ratio':>12s} {'q8 ratio':>12s} {'max_tokens':>10s}")
    for name, cells in res.items():
        mt = kernels.max_tokens(GGMLType[name], 32)
        for key, c in cells.items():
            nat, q8, wide, wq8 = c["native"], c["native-q8"], c["wide"], c["wide-q8"]
            print(f"  {name:8s} {key:>16s}" + "".join(
                f"{v[0]:9.0f} ({v[1]:4.0f})" for v in (nat, q8, wide, wq8)) +
                f"{wide[0] / nat[0]:7.2f} ({wide[1] / nat[1]:.2f})"
                f"{wq8[0] / q8[0]:7.2f} ({wq8[1] / q8[1]:.2f}){mt:>10d}")
    print("geometric mean over the shapes of wide / native wall time, exact (q8: wide-q8 / "
          "native-q8); limit: the widest batch up to which every mean is at least 1.05")
    for name, cells in res.items():
        by_nt: dict[int, dict[str, list[float]]] = {}
        for key, c in cells.items():
            d = by_nt.setdefault(int(key.rsplit("/", 1)[1]), {"native": [], "native-q8": []})
            d["native"].append(c["wide"][1] / c["native"][1])
            d["native-q8"].append(c["wide-q8"][1] / c["native-q8"][1])
        means = {nt: {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in d.items()}
                 for nt, d in sorted(by_nt.items())}
        limits = {}
        for k in ("native", "native-q8"):
            limits[k] = 0
            for nt, m in means.items():
                if m[k] < 1.05:
                    break
                limits[k] = nt
        print(f"  {name:8s} " + "  ".join(f"{nt}: {m['native']:.2f} ({m['native-q8']:.2f})"
                                         for nt, m in means.items())
              + f"  limit {limits['native']} ({limits['native-q8']})")


def print_isa_compare(res: dict, threads: int) -> None:
    print(f"µs per product, best of rounds, {threads} thread(s); ratio = avx2 / avx512; load "
          f"average {os.getloadavg()[0]:.1f}")
    print(f"  {'type':8s} {'shape/tokens':>16s}" + "".join(
        f"{m + ' ' + c:>14s}" for m in ("exact", "q8") for c in ("avx2", "avx512", "ratio")))
    for name, cells in res.items():
        for key, modes in cells.items():
            line = f"  {name:8s} {key:>16s}"
            for m in ("exact", "q8"):
                a, z = modes[m].get("avx2"), modes[m].get("avx512")
                line += f"{a:14.0f}" if a else f"{'-':>14s}"
                line += f"{z:14.0f}{a / z:13.2f}x" if a and z else f"{'-':>14s}{'-':>14s}"
            print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES))
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-ff", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8, help="experts per layer call (8)")
    ap.add_argument("--pool", type=int, default=128, help="experts to pick from (128)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layer", default="q4_k,q4_k,q6_k",
                    help="gate,up,down types of the layer call (q4_k,q4_k,q6_k)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--isa-compare", action="store_true",
                    help="time each type on every vector ISA of this CPU (see the docstring)")
    ap.add_argument("--isa", choices=("scalar", "avx2", "avx512"),
                    help="run the kernels' code for this ISA (default: the best the CPU has); "
                    "with EXPERTFS_GEMM=mkl on an AMD CPU, an AVX2 box's products")
    ap.add_argument("--prefill", action="store_true",
                    help="native products against wide_linear at prefill widths (docstring)")
    ap.add_argument("--shapes", help="rows x cols (--isa-compare: 2048x4096,4096x2048; "
                    f"--prefill: {PREFILL_SHAPES})")
    ap.add_argument("--tokens", help="tokens per product (--isa-compare: 1,8; --prefill: "
                    f"{PREFILL_TOKENS})")
    a = ap.parse_args()
    a.shapes = a.shapes or (PREFILL_SHAPES if a.prefill else "2048x4096,4096x2048")
    a.tokens = a.tokens or (PREFILL_TOKENS if a.prefill else "1,8")
    torch.set_num_threads(a.threads)
    from expertfs.runtime import kernels
    if not kernels.available():
        raise SystemExit(f"native kernels unavailable: {kernels.status()['reason']}")
    if a.isa:
        kernels.load().set_isa(a.isa)
    if a.prefill:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        res = prefill([GGMLType[n.upper()] for n in a.types.split(",")], shapes,
                      [int(v) for v in a.tokens.split(",")], a.rounds)
        if a.json:
            print(json.dumps({"threads": a.threads, "load_avg": os.getloadavg(),
                              "us_per_product_cpu_wall": res}, indent=2))
        else:
            print_prefill(res, a.threads)
        return 0
    if a.isa_compare:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        res = isa_compare([GGMLType[n.upper()] for n in a.types.split(",")], shapes,
                          [int(v) for v in a.tokens.split(",")], a.threads, a.rounds)
        if a.json:
            print(json.dumps({"threads": a.threads, "load_avg": os.getloadavg(),
                              "us_per_product": res}, indent=2))
        else:
            print_isa_compare(res, a.threads)
        return 0
    D, ff = a.n_embd, a.n_ff
    rows = {}
    for name in a.types.split(","):
        t = GGMLType[name.upper()]
        rows[t.name] = per_type(t, D, ff, a.threads, a.rounds)
    lt = tuple(GGMLType[n.upper()] for n in a.layer.split(","))
    if len(lt) != 3:
        raise SystemExit("--layer takes three types: gate,up,down")
    lay = layer(lt, D, ff, a.experts, a.pool, a.threads, a.rounds)
    lname = "_".join(t.name.lower().replace("_", "") for t in lt)      # q4k_q4k_q6k
    for r in rows.values():
        if isinstance(r.get("eager"), float) and isinstance(r.get("native"), float):
            r["speedup"] = r["eager"] / r["native"]
    res = {"threads": a.threads, "n_embd": D, "n_ff": ff, "kernels": kernels.status(),
           "load_avg": os.getloadavg(), "us_per_expert": rows,
           f"layer_{lname}_us_per_expert": lay}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    weights = 3 * D * ff
    print(f"one expert = gate+up {ff}x{D} and down {D}x{ff} ({weights / 1e6:.2f} M weights), "
          f"1 token, {a.threads} thread(s), {kernels.status()['isa']}; µs per expert "
          f"(Gweights/s); load average {res['load_avg'][0]:.1f}")
    cols = ("native", "native-q8", "compiled", "eager", "f32")
    print(f"  {'type':8s}" + "".join(f"{c:>18s}" for c in cols) + f"{'speed-up':>10s}")
    for name, r in rows.items():
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{'-':>18s}" if v is None else f"{v:>18s}" if isinstance(v, str)
                         else f"{v:9.1f} ({weights / v / 1e3:5.1f})")
        sp = r.get("speedup")
        print(f"  {name:8s}" + "".join(cells) + (f"{sp:9.1f}x" if sp else f"{'-':>10s}"))
    names = "/".join(t.name for t in lt)
    print(f"layer call, {a.experts} of {a.pool} experts ({names} gate/up/down), cold: "
          f"exact {lay['exact']:.1f} µs/expert, q8 {lay['q8']:.1f} µs/expert")
    return 0


if __name__ == "__main__":
    sys.exit(main())
