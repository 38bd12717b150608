#!/usr/bin/env python3
"""Where a resident decode token's time goes, product by product: the native kernels' calls
(``kernels.matvec`` by type, shape and tokens; ``kernels.moe`` per MoE layer; ``kernels.qgemm``;
the router, attention, norm and state steps) timed in one process, the store resident (every
expert in the RAM tier), after an untimed warm-up, in ms a token; the rest of the step (Python
and torch's own ops) is the total less their sum. Any architecture; CPU only (the CUDA path
does not call these).

    .venv/bin/python bench/decode_products.py STORE.efs -n 16 --prompt-tokens 128 -t 2
"""

from __future__ import annotations

import argparse
import collections
import os
import time

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import torch  # noqa: E402


def install(kernels, spent: dict, calls: collections.Counter) -> None:
    """Wrap the kernels' entry points with wall-clock timers keyed by what they multiply."""
    def wrap(name: str, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                key = name
                if name == "matvec":
                    x, t, shape = args[0], args[2], args[3]
                    nt = x.shape[0] if x.dim() > 1 else 1
                    key = f"matvec {getattr(t, 'name', t)} {tuple(shape)} x{nt}"
                spent[key] += time.perf_counter() - t0
                calls[key] += 1
        return timed
    for name in ("matvec", "moe", "qgemm", "route", "attn_decode", "rms_norm", "norm_rope_",
                 "kda_step_", "sinkhorn_", "moe_hidden", "moe_down_rows", "moe_combine"):
        setattr(kernels, name, wrap(name, getattr(kernels, name)))


def resident(store: str, act_quant: str, prompt_tokens: int, n: int):
    """The store opened with every expert in the RAM tier and warmed, and a seeded random
    prompt of ``prompt_tokens`` tokens and ``n`` decode inputs: ``(engine, prompt, steps)``."""
    from expertfs.runtime.engine import Engine
    size = os.path.getsize(os.path.join(store, "experts.bin"))
    eng = Engine.open(store, provider="tiered", ram_bytes=size + (64 << 20),
                      act_quant=act_quant)
    eng.warm()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 1000, (prompt_tokens,), generator=g).tolist()
    steps = torch.randint(1, 1000, (n,), generator=g).tolist()
    return eng, prompt, steps


def timed_decode(eng, prompt: list[int], steps: list[int], after_prefill=None) -> float:
    """Seconds to decode ``steps`` after a fresh prefill of ``prompt`` (the prefill untimed;
    ``after_prefill()``, when given, runs between the two)."""
    eng.reset()
    eng.prefill(prompt)
    if after_prefill is not None:
        after_prefill()
    t0 = time.perf_counter()
    for t in steps:
        eng.decode(t)
    return time.perf_counter() - t0


def resident_args(description: str) -> argparse.ArgumentParser:
    """The options of a resident decode timing (``resident``'s and the thread count)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("store")
    ap.add_argument("-n", type=int, default=16, help="decode steps timed")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--act-quant", choices=("off", "q8"), default="off",
                    help="run's --act-quant (q8: llama.cpp's activations, expert and trunk)")
    return ap


def main() -> int:
    ap = resident_args(__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=20, help="rows printed")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertfs.runtime import kernels
    spent: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    install(kernels, spent, calls)
    eng, prompt, steps = resident(a.store, a.act_quant, a.prompt_tokens, a.n)
    timed_decode(eng, prompt, steps[:2])                      # warm-up

    def clear() -> None:                                      # only the decode's calls count
        spent.clear()
        calls.clear()
    total = timed_decode(eng, prompt, steps, clear) / a.n * 1e3
    print(f"{a.store}: {total:.1f} ms a decode token after a {a.prompt_tokens}-token prompt, "
          f"{a.n} steps, {a.threads} threads")
    for key, s in sorted(spent.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"{s / a.n * 1e3:9.2f} ms {calls[key] / a.n:6.1f} calls  {key}")
    print(f"{total - sum(spent.values()) / a.n * 1e3:9.2f} ms            the rest of the step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
