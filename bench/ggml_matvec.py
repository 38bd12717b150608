#!/usr/bin/env python3
"""Products of one or a few tokens from cold weights: expertfs's native kernels (exact and q8,
as the runtime dispatches them: the rows kernels up to ``kernels.max_tokens`` of the type, the
panel product past it) against llama.cpp's own ``ggml_mul_mat`` on the same bytes, in one
process.

For each ``--types`` × ``--shapes`` (rows x cols), enough matrices of random valid blocks
(``bench_kernels.weight``) to exceed the last-level cache are multiplied by ``--tokens`` float32
tokens (one, as a decode step; a few, as a prefill's expert takes its share of a prompt), round
robin, so every product reads its weights from memory as a decode step does. ggml runs
through the ``libggml-base``/``libggml-cpu`` that llama-cpp-python ships (a graph of one
``mul_mat`` per matrix, ``ggml_graph_compute_with_ctx`` with the same thread count; it quantizes
the activation to its ``vec_dot_type`` inside, as llama.cpp's decode and its expert products
in a prompt do). The three paths alternate round by round; medians of ``--rounds``, in weights
per second (rows x cols over a product's time, whatever its tokens) and bytes per second.

    .venv/bin/python bench/ggml_matvec.py --types q6_k,q8_0,iq2_xxs --shapes 2048x4096,154880x4096
    .venv/bin/python bench/ggml_matvec.py --types iq1_s,q4_k --shapes 2048x7168 --tokens 1,4,8
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import sys
import time

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import weight  # noqa: E402

from expertfs.formats.ggml import GGMLType  # noqa: E402

#: bytes of weights per set of matrices: past this box's last-level cache
COLD_BYTES = 160 << 20


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


def _ggml() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    import llama_cpp
    lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    base = ctypes.CDLL(glob.glob(os.path.join(lib, "libggml-base.so*"))[0], mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(glob.glob(os.path.join(lib, "libggml-cpu.so*"))[0], mode=ctypes.RTLD_GLOBAL)
    vp = ctypes.c_void_p
    for name, res, args in (("ggml_init", vp, [_InitParams]),
                            ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, ctypes.c_int64,
                                                        ctypes.c_int64]),
                            ("ggml_mul_mat", vp, [vp, vp, vp]), ("ggml_new_graph", vp, [vp]),
                            ("ggml_build_forward_expand", None, [vp, vp]),
                            ("ggml_get_data", vp, [vp]), ("ggml_free", None, [vp])):
        f = getattr(base, name)
        f.restype, f.argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    cpu.ggml_cpu_init()
    return base, cpu


def ggml_step(base, cpu, t: GGMLType, raws: list[torch.Tensor], x: torch.Tensor, rows: int,
              cols: int, threads: int):
    """A callable computing every ``raws[i] @ x`` (``x [tokens, cols]``) through one ggml graph;
    and its context."""
    ctx = base.ggml_init(_InitParams(sum(r.numel() + 4096 for r in raws) + (1 << 30), None, False))
    xt = base.ggml_new_tensor_2d(ctx, int(GGMLType.F32), cols, x.shape[0])
    ctypes.memmove(base.ggml_get_data(xt), x.contiguous().data_ptr(), x.numel() * 4)
    graph = base.ggml_new_graph(ctx)
    for r in raws:
        wt = base.ggml_new_tensor_2d(ctx, int(t), cols, rows)
        ctypes.memmove(base.ggml_get_data(wt), r.data_ptr(), r.numel())
        base.ggml_build_forward_expand(graph, base.ggml_mul_mat(ctx, wt, xt))
    return (lambda: cpu.ggml_graph_compute_with_ctx(ctx, graph, threads)), ctx


def product(base, cpu, kernels, name: str, t: GGMLType, raws: list[torch.Tensor], rows: int,
            cols: int, tokens: int, a: argparse.Namespace) -> None:
    """One row of the table: ``raws`` times ``tokens`` tokens by the three paths, alternating."""
    nbytes = raws[0].numel()
    x = torch.randn(tokens, cols)

    def native(mode: str):                  # as the runtime dispatches: rows kernels, panels
        if tokens <= kernels.max_tokens(t, 32, mode):
            return lambda: [kernels.matvec(x, r, t, (rows, cols), mode) for r in raws]
        return lambda: [kernels.qgemm(x, r, t, (rows, cols), mode) for r in raws]
    gstep, ctx = ggml_step(base, cpu, t, raws, x, rows, cols, a.threads)
    paths = {"exact": native("off"), "q8": native("q8"), "ggml": gstep}
    rate: dict[str, list[float]] = {k: [] for k in paths}
    for f in paths.values():
        f()                                                           # warm-up
    for r in range(a.rounds):
        for k in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            t0 = time.perf_counter()
            paths[k]()
            rate[k].append(len(raws) / (time.perf_counter() - t0))
    m = {k: statistics.median(v) for k, v in rate.items()}            # matrices per second
    gw = rows * cols / 1e9
    print(f"{name:8s} {rows}x{cols:<6d} {tokens:6d} {m['exact'] * gw:11.1f} {m['q8'] * gw:8.1f} "
          f"{m['ggml'] * gw:10.1f} {m['ggml'] * nbytes / 1e9:10.1f} "
          f"{m['exact'] / m['ggml']:11.2f} {m['q8'] / m['ggml']:8.2f}", flush=True)
    base.ggml_free(ctx)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="q4_k,q6_k,q8_0,iq2_xxs,iq2_s,iq3_xxs")
    ap.add_argument("--shapes", default="2048x4096,4096x2048,768x2048")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1", help="tokens per product, comma-separated (1)")
    a = ap.parse_args()
    from expertfs.runtime import kernels
    kernels.set_threads(a.threads)
    torch.set_num_threads(a.threads)
    base, cpu = _ggml()
    print(f"cold products, {a.threads} threads, expertfs kernels "
          f"{kernels.status()['isa']}; medians of {a.rounds} alternating rounds")
    print(f"{'type':8s} {'shape':>12s} {'tokens':>6s} {'exact Gw/s':>11s} {'q8 Gw/s':>8s} "
          f"{'ggml Gw/s':>10s} {'ggml GB/s':>10s} {'exact/ggml':>11s} {'q8/ggml':>8s}")
    for name in a.types.split(","):
        t = GGMLType[name.upper()]
        for shape in a.shapes.split(","):
            rows, cols = map(int, shape.split("x"))
            raws = [weight(t, rows, cols, s) for s in range(max(2, COLD_BYTES // (rows * cols)))]
            for nt in (int(v) for v in a.tokens.split(",")):
                product(base, cpu, kernels, name, t, raws, rows, cols, nt, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
