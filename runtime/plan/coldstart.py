"""The start of a run: ``expertfs run`` starts with empty tiers. Its prompt reads every expert it
touches into them (that is the first token's time, ``plan.prefill``); then, over a short
generation, two costs are not amortised away and each of the run's ``n`` tokens pays its share,
on top of the steady state that ``predict``'s other terms describe:

- ``first_reads`` (storage): the experts the decode touches that the prompt did not, read once.
  Counted as for uniform routing: the most a layer can see in ``n`` tokens after ``P`` prompt
  tokens is what ``P + n`` tokens touch less what ``P`` touch (skewed routing touches fewer).
  Only their hit share counts (misses are read in the steady state anyway), and the fill never
  passes the room the prompt left in the tiers. At the slow end they get half the drive
  (``WARM_SHARE``) and never more time than the same experts would take as misses; at the fast
  end they share the drive with the misses, overlapped with compute like them.
- ``warm_start`` (CPU): the warm start fills the rest of the RAM tier in the
  background, one read at a time, while the decode computes, and the CPU those reads cost
  (``Rates.read_cpu``, seconds per GB, measured with the drive: system calls, page pinning,
  completions), with the checksums of each expert's first load (``Rates.verify``:
  ``verify_cost``), is taken from the decode's cores. What it has left to read is the RAM tier less
  what the prompt loaded, as much as the more skewed routing replay's first ``P`` tokens touch
  (``Routing.prompt_cover``); per token it reads at most its share of the drive over the
  token's compute time, at each end at that end's drive, CPU and compute rates (those cores
  are the decode's: the fast end cannot hide it either). Over a short run a larger RAM tier
  can so cost a little more than the misses it saves.

Where ``run``'s RAM tier is the experts file mapped (``cache.slots.maps_tier``: a tier that
holds every expert, on the CPU, the file mostly in the page cache), the experts the page cache
holds are mapped, not read: the prompt's reads, the first reads and the warm start's count only
the share the page cache lacks (``drive_share``), and those land in the page cache, not in
fresh memory of the tier's own. Where the prompt's reads go through the spare slots of a slab of
every expert (``cache.window``), the tiers keep none of them: both terms count from empty tiers.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .geometry import Geometry
from .rates import Range

__all__ = ["WARM_SHARE", "distinct_experts", "drive_share", "window_spare", "first_read_bytes",
           "first_read_seconds", "store_page_cache", "verify_cost", "warm_read_bytes",
           "start_terms", "STATED_VERIFY_S_PER_GB"]

#: CPU seconds a GB of checksums takes without a probe (slow, fast end): xxh3_64 over experts
#: read from memory on one core, slower than the probe (``verify_cost``) finds on recent x86
STATED_VERIFY_S_PER_GB = (0.1, 0.05)

#: share of the drive the first reads get at the slow end: the warm start reads the rest of the
#: tier at the same time, and at worst takes the other half
WARM_SHARE = 0.5


def store_page_cache(data_path: str | None) -> float:
    """The share of a store's experts file the page cache holds now (``io.mapped``), which
    decides whether ``run`` maps its RAM tier (``drive_share``); 0 for a GGUF (``run`` reads
    the store made from it) or a model described by flags."""
    from ...store.layout import EXPERTS_FILE
    if not data_path or os.path.basename(data_path) != EXPERTS_FILE \
            or not os.path.isfile(data_path):
        return 0.0
    from ..io.mapped import page_cache_share
    return page_cache_share(data_path)


def drive_share(g: Geometry, mem: Any, page_cache: float) -> float:
    """The share of the experts a run's start reads from the drive with the tiers of ``mem``
    (``budget.Memory``): all of them where ``run`` reads them into a slab (O_DIRECT: what the
    page cache holds does not count), only what the page cache lacks (``page_cache``: the share
    of the experts file it holds now) where ``run``'s RAM tier is the mapped experts file: the
    same rule as ``run``'s (``cache.slots.maps_tier``), for its defaults (``--ram-tier auto``,
    the backend ``auto`` picks) and the tiers this plan recommends."""
    from ..cache.slots import maps_tier
    pl = mem.placement
    mapped = maps_tier("auto", fits=mem.ram.tier_slots >= g.n_decode_experts, cuda=pl.gpu,
                       alone=not (mem.vram and mem.vram.tier_slots), auto_backend=True,
                       cached=lambda: page_cache)
    return max(0.0, 1.0 - page_cache) if mapped else 1.0


def window_spare(g: Geometry, mem: Any, drive: float) -> int:
    """The spare slots ``run``'s prompt reads through (``cache.window``) with the tiers of
    ``mem``: the RAM tier's bytes beyond its slot per expert (``budget.layout`` sizes them only
    for a CPU tier of every expert, where the window is asked for), in a slab (``drive`` 1: not
    the mapped experts file); 0 elsewhere."""
    spare = mem.ram.tier_bytes // g.slot_bytes - mem.ram.tier_slots
    return spare if spare > 0 and drive == 1.0 else 0


def distinct_experts(n_experts: float, k: int, tokens: int) -> float:
    """Expected distinct experts of one layer touched by ``tokens`` tokens of top-``k`` routing
    spread uniformly over ``n_experts``."""
    if n_experts <= 0 or k <= 0 or tokens <= 0:
        return 0.0
    k = min(k, n_experts)
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


def first_read_bytes(g: Geometry, hit_rate: float, tokens: int, tier_bytes: int,
                     prompt_tokens: int = 0) -> float:
    """Bytes read once during ``tokens`` decode tokens after a ``prompt_tokens`` prompt, for
    experts that the steady state counts as hits (``hit_rate``: VRAM + RAM hits of the
    routing) and the prompt did not load; bounded by the room the prompt left in ``tier_bytes``
    (what the tiers hold)."""
    hit = min(1.0, max(0.0, hit_rate))
    every = float(sum(g.extent_bytes) * g.n_experts)

    def touched(n: int) -> float:
        return distinct_experts(g.n_experts, g.k, n) / max(1, g.n_experts) * every

    left = max(0.0, tier_bytes - touched(prompt_tokens))      # room the prompt left in the tiers
    return min(left, hit * (touched(prompt_tokens + tokens) - touched(prompt_tokens)))


def first_read_seconds(bytes_total: float, tokens: int, gbps: float) -> float:
    """Seconds a token of a ``tokens``-token generation spends on ``bytes_total`` of first reads
    at ``gbps`` GB/s."""
    if bytes_total <= 0 or tokens <= 0:
        return 0.0
    return bytes_total / tokens / (gbps * 1e9)


def warm_read_bytes(g: Geometry, ram_tier_bytes: int, prompt_cover: float) -> float:
    """What the warm start has left to read into the RAM tier after a prompt that loaded
    ``prompt_cover`` of every layer's experts."""
    every = float(sum(g.extent_bytes) * g.n_experts)
    fill = min(float(max(0, ram_tier_bytes)), every)
    return max(0.0, fill - min(fill, max(0.0, min(1.0, prompt_cover)) * every))


def verify_cost(probe: bool = True) -> Range:
    """CPU seconds a GB of the reader's checksums takes (``io.ExpertReader``, ``verify="first"``:
    xxh3_64 of each part of an expert on its first read in a process, mapped or read, on the
    I/O engine's threads, so on the cores the forward pass computes on): measured over 128 MiB
    in 3 MiB parts, more than the caches hold (best of three, the slow end 1.5x), or stated."""
    if not probe:
        return Range(*STATED_VERIFY_S_PER_GB, "stated default: CPU seconds per GB of checksums")
    import numpy as np
    import xxhash
    buf = np.full(128 << 20, 7, dtype=np.uint8)
    part, best = 3 << 20, float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for off in range(0, buf.size, part):
            xxhash.xxh3_64_intdigest(buf[off:off + part])
        best = min(best, time.perf_counter() - t0)
    s = best / (buf.size / 1e9)
    return Range(1.5 * s, s, "measured now: xxh3_64 over 128 MiB in 3 MiB parts (slow end 1.5x)")


def start_terms(g: Geometry, *, hits: tuple[float, float], tier_bytes: int, ram_tier_bytes: int,
                prompt_tokens: int, n_predict: int, prompt_cover: float, storage: Range,
                read_cpu: Range, compute_s: tuple[float, float], drive: float = 1.0,
                verify: Range | None = None, window: bool = False
                ) -> list[tuple[str, float, float, str]]:
    """The two terms (name, slow s, fast s, detail) for a token of an ``n_predict``-token run
    after a ``prompt_tokens`` prompt: ``hits`` the steady hit rates at each end,
    ``prompt_cover`` the share of the experts the slow end's prompt loads, ``compute_s`` a
    token's compute at each end (the slow end's: the warm start's time to read in); ``drive``
    the share of those experts read from the drive (``drive_share``), the rest mapped from the
    page cache, which costs the warm start their checksums only (``verify``: CPU s/GB, at most
    what one thread checksums over the token's compute). ``window``: the prompt's reads went
    through the tier's spare slots (``cache.window``), so the tiers start the decode empty."""
    MiB, n, P = 1 << 20, max(1, n_predict), max(0, prompt_tokens)
    if window:
        P = prompt_cover = 0
    cold = [drive * first_read_bytes(g, h, n, tier_bytes, P) for h in hits]
    as_misses = drive * hits[0] * g.token_expert_bytes / (storage.slow * 1e9)
    reads = (min(as_misses, first_read_seconds(cold[0], n, storage.slow * WARM_SHARE))
             + (cold[0] / n / 1e9 * read_cpu.slow if window else 0.0),   # into fresh slots
             first_read_seconds(cold[1], n, storage.fast))
    uniform = distinct_experts(g.n_experts, g.k, P) / max(1, g.n_experts)
    left_all = warm_read_bytes(g, ram_tier_bytes, min(prompt_cover, uniform))
    left = drive * left_all                                       # what the drive serves

    def warm_at(e: str) -> tuple[float, float, float]:
        """(bytes read, bytes mapped, CPU seconds) a token of the warm start at end ``e``."""
        ck, c = (verify.at(e) if verify is not None else 0.0), compute_s[e == "fast"]
        w = min(left / n, WARM_SHARE * storage.at(e) * 1e9 * c)
        mapped = min((left_all - left) / n, c * 1e9 / ck) if ck else 0.0
        return w, mapped, (w * (read_cpu.at(e) + ck) + mapped * ck) / 1e9
    (warm, mapped, cpu_slow), cpu_fast = warm_at("slow"), warm_at("fast")[2]
    check = verify.slow if verify is not None else 0.0
    after = (f"after a {P}-token prompt" if P else "from empty tiers"
             + (" (the prompt's reads in the spare slots)" if window else ""))
    return [("first_reads", *reads, f"{cold[0] / MiB:.0f} MiB read once over a run of {n} tokens "
             f"{after} ({cold[0] / n / MiB:.1f} MiB/token)"),
            ("warm_start", cpu_slow, cpu_fast,
             f"{warm / MiB:.0f} MiB/token read into the RAM tier in the background"
             + (f", {mapped / MiB:.0f} MiB/token mapped from the page cache" if mapped else "")
             + f" ({left_all / MiB:.0f} MiB left after the prompt) at {read_cpu.slow:.2f} CPU s/GB"
             + (f" + {check:.2f} of checksums" if check else "") + " (slow end)")]
