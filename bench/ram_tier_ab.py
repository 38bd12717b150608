#!/usr/bin/env python3
"""Resident decode from the two RAM tiers of a tier that holds every expert, in one process: the
store opened twice, once with its RAM tier the mapped experts file (``ram_tier="mapped"``,
``runtime.io.mapped``) and once a slab, each warmed (every expert read), then the same prompt
and decode steps timed on each in alternating rounds (``decode_products.timed_decode``), so the
box's drift between processes does not enter the comparison. Needs RAM for the store twice.

    .venv/bin/python bench/ram_tier_ab.py STORE.efs --rounds 8 -n 32
"""

from __future__ import annotations

import argparse
import os
import statistics

from decode_products import timed_decode

from expertfs.runtime.openmp import configure  # noqa: I001

configure()

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("-n", type=int, default=32, help="decode steps a round")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from expertfs.runtime.engine import Engine
    ram = os.path.getsize(os.path.join(a.store, "experts.bin")) + (64 << 20)
    engines = {}
    for tier in ("mapped", "slab"):
        eng = Engine.open(a.store, provider="tiered", ram_bytes=ram,
                          provider_options={"ram_tier": tier})
        eng.warm()
        assert eng.provider.describe()["ram_tier"] == tier
        engines[tier] = eng
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 1000, (a.prompt_tokens,), generator=g).tolist()
    steps = torch.randint(1, 1000, (a.n,), generator=g).tolist()
    for eng in engines.values():
        timed_decode(eng, prompt, steps[:4])                  # warm-up
    ms: dict[str, list[float]] = {t: [] for t in engines}
    for r in range(a.rounds):
        for tier in (("mapped", "slab") if r % 2 == 0 else ("slab", "mapped")):
            ms[tier].append(timed_decode(engines[tier], prompt, steps) / a.n * 1e3)
    for tier, v in ms.items():
        print(f"{tier:6s} median {statistics.median(v):.1f} ms a token; rounds "
              + " ".join(f"{x:.1f}" for x in v))
    for eng in engines.values():
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
