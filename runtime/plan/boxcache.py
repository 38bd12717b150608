"""This machine's measured rates, kept between plans: a JSON under ``~/.cache/expertfs/``
(``EXPERTFS_PLAN_CACHE`` names another file) keyed by the CPU model, the native kernels' ISA
and build, torch's thread count (CPU entries) and the device holding a store (storage
entries). ``cpu_rates`` measures only what the cache lacks for a model and stores it;
``--no-probe`` reads the cache and measures nothing.

A CPU entry carries the speed check it was measured beside (``native.speed_check``). Before a
probing plan uses it, the check runs again (a quarter of a second); when the box's speed has
moved by more than ``DRIFT`` since, or the entry has no check, the entry is dropped and
measured anew, so a plan says what the box does now, not what it did when it was busier or
idler. Every check is also kept (``plan.spread``: those of the last day): the slowest and
fastest of them, against the entry's, widen the slow and fast ends of every CPU figure the
cache gives (``with_spread``, ``spread_range``), so on a box whose speed moves (a shared
machine, a virtual one, thermal limits) the band holds what the box has been doing, not one
moment of it."""

from __future__ import annotations

import json
import logging
import math
import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from .geometry import Geometry
from .rates import FLOAT_TYPES, DeviceRates, LinearCost, Range, stated_cpu
from .spread import recent_checks, spread_of, spread_range, storage_spread, with_spread

logger = logging.getLogger(__name__)

__all__ = ["cache_path", "cpu_key", "storage_key", "load", "save", "cpu_rates", "drive_rate",
           "gemm_rate", "dequant_rates", "panel_rates", "spread_of", "with_spread", "recent_checks",
           "storage_spread", "spread_range", "verify_rate"]


def cache_path() -> str:
    env = os.environ.get("EXPERTFS_PLAN_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "expertfs", "plan-rates.json")


def _cpu_model() -> str:
    from ..kernels import cpu
    return cpu.info().model_name or platform.processor() or platform.machine()


#: how the CPU probes measure; raised when that changes, so no entry of the old way is used
#: (2: the kernels timed on weights past the last-level cache, ``coldweights.CAP``; 3: the float
#: products through ``kernels.gemm``, whose library is part of the key; 4: past a last-level
#: cache of any size, ``coldweights.cold_bytes``; 5: the check run again after the figures, the
#: entry keeping the slower, ``_bracket``). The per-layer overhead is kept per
#: architecture under ``overhead``, beside which an entry's old single figure is never read:
#: that change needed no new version, so the kernels' figures and speed checks stay valid.
PROBE_VERSION = 5


def cpu_key() -> str:
    import torch

    from ..kernels import gemm
    from .native import kernel_info
    k = kernel_info()
    native = f"{k.get('isa')}|{k.get('build')}" if k.get("available") else "no-native"
    return (f"cpu|{_cpu_model()}|{native}|gemm {gemm.backend()}|threads {torch.get_num_threads()}"
            f"|probe {PROBE_VERSION}")


#: bumped when the storage probe changes what it measures: older entries are measured again
#: (2: the fresh-memory CPU from the cheaper of two points; 3: the dearer one too, the slow
#: end's: ``plan.storage_probe``; 4: the fresh slab on the pages the RAM tier takes,
#: ``io.pages``; 5: every read into such pages, whose size moves a read's rate)
STORAGE_PROBE_VERSION = 5


def storage_key(path: str, read_bytes: int = 0) -> str:
    """The device holding ``path`` and, with ``read_bytes``, the size class of one read (a
    power of two: a drive's rate depends on the read size, so a store of small experts says
    nothing of one with large)."""
    size = f"|reads 2^{round(math.log2(read_bytes))}" if read_bytes > 0 else ""
    try:
        return f"storage|dev {os.stat(path).st_dev}{size}|probe {STORAGE_PROBE_VERSION}"
    except OSError:
        return f"storage|unknown{size}|probe {STORAGE_PROBE_VERSION}"


def load() -> dict[str, Any]:
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def drive_rate(data_path: str, read_bytes: int) -> float | None:
    """The cached read rate (bytes/s, the fast end) of the drive holding ``data_path`` at reads
    of ``read_bytes``, as ``plan`` measured it; None when this device was never measured."""
    hit = load().get(storage_key(data_path, read_bytes))
    if isinstance(hit, dict) and "fast" in hit:
        try:
            return float(hit["fast"]) * 1e9
        except (TypeError, ValueError):
            return None
    return None


def save(data: dict[str, Any]) -> None:
    """Write the cache (a failure to write is not an error: the next plan measures again)."""
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


#: how far (a ratio either way) the speed check may move before the cached CPU rates are
#: measured anew; within it, the box's drift between runs (bench/README.md)
DRIFT = 1.25

#: the budget of each speed check run after a probe (``_bracket``): a tenth of a second
CHECK_AFTER_S = 0.1

_EARLIER = {"on": False}             # set while an entry read from the cache is rebuilt


def _range(d: dict[str, Any]) -> Range:
    src = str(d.get("source", ""))
    if _EARLIER["on"]:
        src = src.replace("measured now", "measured earlier on this machine (cached)")
    return Range(float(d["slow"]), float(d["fast"]), src)


@contextmanager
def _read_back(on: bool = True) -> Iterator[None]:
    """While ``on``, the ranges rebuilt from cache entries say they were measured earlier."""
    _EARLIER["on"] = on
    try:
        yield
    finally:
        _EARLIER["on"] = False


def _cost(d: dict[str, Any]) -> LinearCost:
    return LinearCost(_range(d["overhead_s"]), _range(d["gbps"]))


def _field_suffix(act_quant: str) -> str:
    """The suffix of an entry's fields measured in ``act_quant``'s numerics (the native
    kernels' figures: ``fused``, ``layers``, ``panel_gflops``): none for exact mode, ``_q8``."""
    return "" if act_quant in (None, "off") else f"_{act_quant}"


def _from_entry(e: dict[str, Any], sfx: str = "", kind: str = "") -> DeviceRates:
    base = stated_cpu()
    over = (e.get("overhead") or {}).get(kind) or {}
    linear = dict(base.linear)
    linear.update({t: _cost(c) for t, c in e.get("linear", {}).items()})
    return DeviceRates("cpu", linear,
                       _range(e["mem_gbps"]) if "mem_gbps" in e else base.mem_gbps,
                       _range(e["op_s"]) if "op_s" in e else base.op_s, base.sync_s,
                       {t: _cost(c) for t, c in e.get("fused" + sfx, {}).items()},
                       {t: _cost(c) for t, c in e.get("layers" + sfx, {}).items()},
                       _range(over["layer_s"]) if over.get("layer_s") else base.layer_s,
                       _range(over["token_s"]) if over.get("token_s") else base.token_s)


def _overhead_kind(g: Geometry, entry: dict[str, Any], tiny: Any,
                   probe: bool) -> tuple[str, int, Any]:
    """(cache key, period, writer) of the per-layer overhead ``g`` is priced by: its own
    architecture's where an earlier plan measured it or a writer of its tiny GGUFs is given
    to measure it now, else the built-in tiny qwen3moe's."""
    from .overhead import overhead_kind
    arch, period = overhead_kind(g)
    key = f"{arch}/{period}"
    if key in (entry.get("overhead") or {}) or (probe and tiny is not None):
        return key, period, tiny
    return "qwen3moe/1", 1, None


def cpu_rates(g: Geometry, cpu_mats: list, *, probe: bool = True, act_quant: str = "off",
              tiny: Any = None) -> tuple[DeviceRates, dict[str, Any]]:
    """The CPU's rates for ``g`` with the native kernels in ``act_quant``'s numerics (run's
    ``--act-quant``): the cached figures of this machine, with whatever ``g`` needs and the
    cache lacks measured now (``probe``) and added to it. ``tiny`` (``overhead.TinyWriter``)
    writes the tiny GGUFs of ``g``'s architecture the per-layer overhead is measured on."""
    from .native import layer_key, probe_expert_layers, probe_trunk_types

    data = load()
    key, sfx = cpu_key(), _field_suffix(act_quant)
    entry = dict(data.get(key) or {})
    detail: dict[str, Any] = {"cache": cache_path(), "key": key, "measured": []}
    if probe:
        from .native import speed_check
        now = speed_check()
        then = entry.get("check_gbps")
        if entry and not (isinstance(then, (int, float)) and then > 0
                          and 1 / DRIFT <= now / then <= DRIFT):
            detail["dropped"] = {"check_gbps_then": then, "check_gbps_now": now}
            entry = {}
    kind, period, tiny = _overhead_kind(g, entry, tiny, probe)
    if probe:
        checks: list[float] = []

        def checked(probed):                # the speed check again after each probe that ran
            checks.append(speed_check(CHECK_AFTER_S))
            return probed
        detail["check_gbps"] = entry.setdefault("check_gbps", now)
        data["speed|" + key] = recent_checks(data.get("speed|" + key), now)
        quant = [m for m in cpu_mats if m.ggml_type not in FLOAT_TYPES]
        fused = dict(entry.get("fused" + sfx, {}))
        missing = [m for m in quant if m.ggml_type not in fused]
        if missing:
            got, d = checked(probe_trunk_types(missing, budget_s=1.5, act_quant=act_quant))
            fused.update({t: c.as_dict() for t, c in got.items()})
            detail["measured"] += d
        layers = dict(entry.get("layers" + sfx, {}))
        want = {layer_key(p, g.k) for p in g.expert_parts}
        if want - set(layers):
            got, d = checked(probe_expert_layers(g, budget_s=2.0, known=list(layers),
                                                 act_quant=act_quant))
            layers.update({t: c.as_dict() for t, c in got.items()})
            detail["measured"] += d
        if "mem_gbps" not in entry or any(m.ggml_type not in entry.get("linear", {})
                                          for m in cpu_mats if m.ggml_type not in fused):
            from .probe import probe_cpu
            rest = [m for m in cpu_mats if m.ggml_type not in fused]
            r, d = checked(probe_cpu(rest, budget_s=1.0))
            entry["linear"] = {**entry.get("linear", {}),
                               **{t: c.as_dict() for t, c in r.linear.items() if t != "*"}}
            entry["mem_gbps"], entry["op_s"] = r.mem_gbps.as_dict(), r.op_s.as_dict()
            detail["torch"] = d
        from .coldweights import release_pool
        release_pool()                            # the kernels' timings are done
        over = dict(entry.get("overhead") or {})
        if kind not in over:
            from .overhead import probe_overhead
            lay, tok, d = checked(probe_overhead(k=4, arch=g.arch, period=period, writer=tiny))
            over[kind] = {"layer_s": lay.as_dict(), "token_s": tok.as_dict()}
            entry["overhead"] = over
            detail["overhead"] = d
        entry["fused" + sfx], entry["layers" + sfx] = fused, layers
        _bracket(entry, detail, now, checks)
        data[key] = entry
        save(data)
    detail["from_cache"] = bool(entry) and not detail["measured"] and "overhead" not in detail \
        and "torch" not in detail
    with _read_back(detail["from_cache"]):
        rates = _from_entry(entry, sfx, kind) if entry else stated_cpu()
    if entry and (spread := _spread(data, key)) is not None:
        detail["spread"] = spread
        rates = with_spread(rates, *spread)
    # nothing measured for a type the native kernels compute: their stated rate, not torch's
    from .native import stated_native
    quant = {m.ggml_type for m in cpu_mats if m.ggml_type not in FLOAT_TYPES}
    stated = stated_native(sorted(quant - set(rates.fused)), rates.mem_gbps)
    if stated:
        rates = replace(rates, fused={**stated, **rates.fused})
        detail["stated_native"] = sorted(stated)
    if rates.layer_s is None and stated:             # the native path's own work, not torch's
        from .native import STATED_NATIVE_LAYER_S, STATED_NATIVE_TOKEN_S
        src = ("stated default: the native path's work beside its products, per layer and "
               "token, over the architectures measured (measure: drop --no-probe)")
        rates = replace(rates, layer_s=Range(*STATED_NATIVE_LAYER_S, src),
                        token_s=Range(*STATED_NATIVE_TOKEN_S, src))
    return rates, detail


def _bracket(entry: dict[str, Any], detail: dict[str, Any], before: float,
             after: list[float]) -> None:
    """The entry's speed check once figures were measured (``after``: the check run again after
    each probe): a box that slowed down while they were (another process took a core) left
    figures that the check before them does not describe, so the entry keeps the slowest
    check. A later plan on the box at its usual speed then sees the drift and measures them
    anew, instead of taking half-speed figures for the box's own for as long as its checks
    stay within ``DRIFT`` of the one made before them."""
    if not after:
        return
    detail["checks_after"] = after
    low = min(after)
    if low < entry["check_gbps"]:
        entry["check_gbps"] = detail["check_gbps"] = low
    if not 1 / DRIFT <= low / before <= DRIFT:
        logger.warning("the box slowed from %.1f to %.1f GB/s while plan measured it: its CPU "
                       "figures may be off until a plan on a quiet box measures them again",
                       before, low)


def _spread(data: dict[str, Any], key: str) -> tuple[float, float] | None:
    """(slow, fast): how far the box's speed checks of the last day moved from the check made
    beside this machine's cached CPU figures (``spread_of``); None without either. Every CPU
    figure the cache gives is widened by it (``cpu_rates``, ``_cached_rate``, ``_type_rates``)."""
    entry, checks = data.get(key) or {}, data.get("speed|" + key)
    if not checks or not isinstance(entry.get("check_gbps"), (int, float)):
        return None
    return spread_of(checks, float(entry["check_gbps"]))


def _cached_rate(name: str, measure: Callable[..., Range], probe: bool,
                 seconds: bool = False) -> Range:
    """This machine's figure ``name`` (a rate, or with ``seconds`` a time): cached, else
    ``measure(probe=probe)`` and cached where it measured, else the stated default ``measure``
    gives; a figure of this machine widened by its speed checks (``_spread``)."""
    data = load()
    key = cpu_key()
    hit = (data.get(key) or {}).get(name)
    if isinstance(hit, dict) and "slow" in hit:
        with _read_back():
            r = _range(hit)
    else:
        r = measure(probe=probe)
        if not (probe and r.source.startswith("measured")):
            return r
        data.setdefault(key, {})[name] = r.as_dict()
        save(data)
    return spread_range(r, *(_spread(data, key) or (1.0, 1.0)), seconds=seconds)


def gemm_rate(probe: bool = True) -> Range:
    """This machine's float32 matrix-multiply rate for the first token (``plan.prefill``)."""
    from .prefill import gemm_rate as measure
    return _cached_rate("gemm_gflops", measure, probe)


def verify_rate(probe: bool = True) -> Range:
    """This machine's CPU seconds per GB of the reader's checksums (``coldstart.verify_cost``)."""
    from .coldstart import verify_cost
    return _cached_rate("verify_s_per_gb", verify_cost, probe, seconds=True)


def _type_rates(field: str, types: list[str], probe: bool, measure) -> dict[str, Range]:
    """Per-type figures cached under ``field`` of this machine's entry: the cached ones, the
    missing ones measured now by ``measure(types)`` (``probe``) and cached."""
    data = load()
    key = cpu_key()
    cached = dict((data.get(key) or {}).get(field) or {})
    missing = [t for t in types if t not in cached]
    if probe and missing:
        got = measure(missing)
        if got:
            cached.update({t: r.as_dict() for t, r in got.items()})
            data.setdefault(key, {})[field] = cached
            save(data)
        out = dict(got)
    else:
        out = {}
    with _read_back():
        out.update({t: _range(cached[t]) for t in types if t in cached and t not in out})
    lo, hi = _spread(data, key) or (1.0, 1.0)
    return {t: spread_range(r, lo, hi) for t, r in out.items()}


def dequant_rates(types: list[str], probe: bool = True) -> dict[str, Range]:
    """This machine's native dequantization rate (G weights/s) per type, for the first token's
    wide products where there is no panel product: cached figures, the missing ones measured
    now (``probe``) and cached."""
    from .native import probe_dequant
    return _type_rates("dequant_gwps", types, probe, probe_dequant)


def panel_rates(types: list[str], probe: bool = True, act_quant: str = "off"
                ) -> dict[str, Range]:
    """This machine's panel product rate (GFLOP/s, ``kernels.qgemm``) per type in
    ``act_quant``'s numerics, for the first token's wide products: cached figures, the missing
    ones measured now (``probe``) and cached."""
    from .native import probe_panel
    return _type_rates("panel_gflops" + _field_suffix(act_quant), types, probe,
                       lambda ts: probe_panel(ts, act_quant=act_quant))
