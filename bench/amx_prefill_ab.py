#!/usr/bin/env python3
"""A prompt's prefill with exact mode's wide products on AMX against the float panel
(``kernels.without_amx``), alternating in one process with every expert and the trunk resident
(``Engine.warm``) and the code paths already run once, so only the products differ: medians of
``--rounds``. Needs a CPU with AMX-BF16.

    .venv/bin/python bench/amx_prefill_ab.py STORE [--prompt-tokens 128] [--rounds 6]

The prompt is ``bench_lowram.py``'s text (its words repeated to ``--prompt-tokens``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

from expertfs.runtime.openmp import configure

configure()                                   # before torch loads OpenMP
from expertfs.runtime import heap  # noqa: E402

heap.configure()

import torch  # noqa: E402

from bench_lowram import long_prompt  # noqa: E402  (bench/, the script's own folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertfs.runtime import kernels
    from expertfs.runtime.engine import Engine
    from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
    from expertfs.store.reader import Store
    mod = kernels.load()
    if mod is None or not mod.info().get("amx"):
        raise SystemExit("this CPU (or OS) has no AMX-BF16: nothing to compare")
    with Store.open(a.store) as st:
        ids = GGUFTokenizer(st.gguf_kv(), a.store).encode(long_prompt(a.store, a.prompt_tokens))
    ram = os.path.getsize(os.path.join(a.store, "experts.bin")) + (64 << 20)
    times: dict[bool, list[float]] = {False: [], True: []}
    with Engine.open(a.store, provider="tiered", ram_bytes=ram) as eng:
        eng.warm()
        eng.prefill(ids)                      # the first prompt's one-off costs
        for _ in range(a.rounds):
            for amx in (False, True):
                with contextlib.nullcontext() if amx else kernels.without_amx():
                    eng.reset()
                    t0 = time.perf_counter()
                    eng.prefill(ids)
                    times[amx].append(time.perf_counter() - t0)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{os.path.basename(os.path.normpath(a.store))}: {len(ids)}-token prefill, medians of "
          f"{a.rounds} alternating: float panel {off * 1e3:.0f} ms, AMX {on * 1e3:.0f} ms, "
          f"{off / on:.2f}x")


if __name__ == "__main__":
    main()
