#!/usr/bin/env python3
"""The device path's operations a decode token, a get's experts dequantized and multiplied one by
one against a group at a time (``runtime.model.expert_groups``: each role dequantized in one
call, the decode step's products over the group at once; issue 17 item 7), in one process.

The device path is the one CUDA takes (no native products: ``fused="off"``); on the CPU it is
the same torch code, so the operations counted here are the kernels a GPU would launch for them,
less the views that launch none (on the CPU each matrix is dequantized whole, as on CUDA, not in
the CPU's row chunks). Every operation the forward dispatches is counted under a
``TorchDispatchMode`` for ``-n`` decode steps after a 16-token prompt, with every expert in the
RAM tier (``warm()``); then the steps are timed with the two settings alternating (medians;
on the CPU the host time of those launches is what moves, not a GPU's). The logits of the two
are compared at every step.

    .venv/bin/python bench/expert_launches.py STORE.efs [--device cuda] [-n 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: operations that launch no compute kernel: views, allocations, reading a scalar
NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "reshape", "alias", "as_strided", "t",
         "transpose", "unsqueeze", "squeeze", "expand", "permute", "detach", "split",
         "split_with_sizes", "chunk", "unbind", "lift_fresh", "_reshape_alias", "unfold",
         "view_as_real", "view_as_complex", "_to_copy_view", "empty", "empty_like",
         "empty_strided", "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride"}


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-n", type=int, default=16, help="decode steps")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertfs.formats.dequant import fused
    from expertfs.runtime.engine import Engine
    fused.DEFAULT_CPU_CHUNK_ELEMS = 0          # whole matrices, as on CUDA
    with Engine.open(a.store, provider="tiered", ram_bytes=64 << 30, device=a.device,
                     fused="off", provider_options={"record_usage": False}) as e:
        e.warm()
        prompt = list(range(3, 19))
        toks = [(7 * i + 5) % 1000 + 3 for i in range(a.n)]
        moe = sum(1 for li in range(e.config.n_layers) if e.config.is_moe(li))
        res = {}
        logits = {}
        for grouped in (False, True):
            e.runner.grouped = e.runner.group_products = grouped
            e.reset()
            e.prefill(prompt)
            c = Count()
            out = []
            with c:
                for t in toks:
                    out.append(e.decode(t))
            logits[grouped] = torch.stack(out).float().cpu()
            total = sum(c.ops.values())
            kernels = total - sum(v for k, v in c.ops.items() if k in NO_KERNEL)
            res[grouped] = (total / a.n, kernels / a.n, c.ops)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i, t in enumerate(toks * 2):
            for grouped in ((False, True) if i % 2 else (True, False)):
                e.runner.grouped = e.runner.group_products = grouped
                e.reset()
                e.prefill(prompt[:4])
                t0 = time.perf_counter()
                e.decode(t)
                if a.device != "cpu":
                    torch.cuda.synchronize()
                times[grouped].append(time.perf_counter() - t0)
        d = (logits[True] - logits[False]).abs().max().item()
        print(f"{a.store}: {e.config.arch}, {e.config.n_layers} layers ({moe} MoE), top "
              f"{e.config.n_expert_used}, device {a.device}, {a.n} decode tokens")
        for grouped in (False, True):
            total, kern, ops = res[grouped]
            name = "grouped  " if grouped else "one by one"
            top = ", ".join(f"{k} {v / a.n:.0f}" for k, v in ops.most_common(5))
            t_ms = statistics.median(times[grouped]) * 1e3
            print(f"  {name}: {kern:7.0f} kernels a token ({total:.0f} operations in all; "
                  f"{kern / max(moe, 1):.0f} a MoE layer); {t_ms:7.1f} ms a token (median of "
                  f"{len(times[grouped])}); most: {top}")
        ms = {g: statistics.median(times[g]) * 1e3 for g in (False, True)}
        print(f"  kernels: {res[True][1] / res[False][1]:.3f}x; time: "
              f"{ms[True] / ms[False]:.3f}x; logits max |d| {d:.2e}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": a.device, "moe_layers": moe, "tokens": a.n,
                           "kernels": {"one_by_one": res[False][1], "grouped": res[True][1]},
                           "ms": {"one_by_one": ms[False], "grouped": ms[True]},
                           "logits_max_abs_diff": d}, f, indent=1)


if __name__ == "__main__":
    main()
