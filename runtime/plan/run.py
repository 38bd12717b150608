"""``expertfs plan`` end to end: inputs → geometry → budget → rates → routing → ``plan.Plan``.

``run_plan(PlanRequest(...))`` is what the CLI calls; it prints nothing. Probes run only where
the plan needs them (CPU: something computes there; GPU: CUDA here and a GPU placement; storage:
a store or GGUF without ``io_profile``); ``probe=False`` takes the stated rates throughout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ...errors import UsageError
from .budget import Box, Memory, candidates
from .coldstart import drive_share, store_page_cache, window_spare
from .geometry import Geometry
from .predict import (Option, Plan, Rates, RoutingRange, make_plan, predict_option, stated_cpu,
                      stated_gpu, stated_pcie, stated_storage, storage_from_profile)
from .rates import STATED_SLOW, Range, miss_cpu_from, read_cpu_from, stated_drive
from .model import load_geometry
from .rereads import trunk_reread_bytes
from .routing import (DEFAULT_SYNTHETIC, DEFAULT_TOKENS, MIN_USAGE_TOKENS, NEW_REQUEST, Coverage,
                      Dynamics, ideal_routing, learned_coverage, learned_dynamics, route, synthetic_replay,
                      trace_replay, usage_replay, usage_tokens)
from ..policies.registry import DEFAULT_POLICY

__all__ = ["PlanRequest", "run_plan", "read_io_profile", "plan_options", "simulator_routing"]


@dataclass(frozen=True)
class PlanRequest:
    target: str | None = None              # a store folder or a .gguf
    model: Any = None                      # or a GGUF described in memory (gguf_read.GGUFModel)
    source: str | None = None              # what the plan calls ``model`` ("--like NAME ...")
    ram: int | None = None                 # None: this machine's (its cgroup cap counts)
    memory_limit: int | None = None        # a cap below ``ram`` (as a cgroup or
                                           # EXPERTFS_MEMORY_LIMIT): no OS headroom inside it
    vram: int | None = None                # None: this machine's first CUDA device, else 0
    ctx: int | None = None                 # None: run's 4096, or the training context if shorter
    kv_type: str = "auto"
    headroom: int | None = None
    pin_budget: int | None = None
    placement: str = "auto"                # auto | gpu | hybrid | cpu
    trunk: str = "auto"                    # auto | float | quant
    io_profile: str | None = None
    trace: str | None = None
    synthetic: tuple[str, ...] = DEFAULT_SYNTHETIC
    policy: str = DEFAULT_POLICY
    tokens: int = DEFAULT_TOKENS
    n_predict: int = 64                    # tokens the run generates (run's -n default)
    prompt_tokens: int = 512               # the prompt the first token's time is predicted for
    seed: int = 0
    probe: bool = True                     # measure what this machine's cache lacks
    use_cache: bool = True                 # without probe: this machine's cached rates if any
    pcie_gen: int = 4
    gpu_gbps: float | None = None          # stated GPU memory bandwidth (fast end; slow end
                                           # STATED_SLOW of it)
    disk_gbps: tuple[float, ...] | None = None   # the planned box's drive at expert-sized random
                                           # reads, stated: (fast,) as gpu_gbps, or (slow, fast)
    act_quant: str = "off"                 # run's --act-quant: the CPU products' numerics
    tiny_store: Any = None                 # overhead.TinyWriter (None: a tiny qwen3moe's)


def read_io_profile(path: str, k: int) -> tuple[Range, dict[str, Any]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such I/O profile", fix="write one with `expertfs bench io "
                         "STORE --json > io.json`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a JSON I/O profile ({e})",
                         fix="pass the output of `expertfs bench io STORE --json`") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: not a JSON object", fix="pass the output of `expertfs bench io --json`")
    return storage_from_profile(data, k, label=f"profile {path}")


DEFAULT_CTX = 4096                         # expertfs run's --ctx default


def _box(req: PlanRequest, n_ctx_train: int, page_cache: float = 0.0) -> Box:
    from ..memory import limit_and_source
    from .probe import cuda_memory

    here = []
    ram, source = req.ram, "physical"
    if ram is None:
        ram, source = limit_and_source()   # what expertfs run reads: cgroup, environment, RAM
        here.append("RAM" if source == "physical" else f"memory limit ({source})")
    if req.memory_limit is not None:
        if req.memory_limit <= 0:
            raise UsageError(f"--memory-limit {req.memory_limit}", fix="give a size such as 6G")
        if req.memory_limit < ram or source == "physical":
            ram, source = min(ram, req.memory_limit), "limit"
    vram = req.vram
    if vram is None:
        vram = cuda_memory()
        here.append("VRAM")
    label = ("this machine's " + " and ".join(here)) if here else "as given"
    if source == "limit":
        label += ", capped by --memory-limit"
    ctx = req.ctx if req.ctx is not None else min(DEFAULT_CTX, n_ctx_train or DEFAULT_CTX)
    return Box(ram, vram, ctx, req.kv_type, req.headroom, req.pin_budget, label, source,
               req.n_predict, req.prompt_tokens, req.act_quant, page_cache)


RoutingFor = Callable[[Memory], RoutingRange]


def plan_options(g: Geometry, box: Box, rates: Rates, routing_for: RoutingFor, *,
                 where: str = "auto", trunk_mode: str = "auto",
                 mems: list[Memory] | None = None) -> list[Option]:
    """Every candidate placement budgeted, routed and predicted (``routing_for(memory)`` gives
    the hit rates at its tier sizes). Branch and bound: an option's prediction with every
    expert cached bounds it from above, so options whose bound cannot beat the best supported
    one found so far are not simulated (``Option.bound`` says what they could not beat)."""
    mems = mems if mems is not None else candidates(g, box, where, trunk_mode)
    ideal = ideal_routing()
    bounds = {id(m): predict_option(g, box, m, rates, ideal).score for m in mems if m.runnable}
    order = sorted((m for m in mems if m.runnable), key=lambda m: (not m.placement.supported,
                                                                     -bounds[id(m)]))
    best = 0.0
    done: dict[int, Option] = {}
    for m in order:
        if bounds[id(m)] < best * (1.0 if m.placement.supported else 1.1):   # cannot matter
            done[id(m)] = Option(m, bound=bounds[id(m)])
            continue
        o = predict_option(g, box, m, rates, routing_for(m))
        done[id(m)] = o
        if m.placement.supported:
            best = max(best, o.score)
    return [done.get(id(m), Option(m)) for m in mems]


Learned = tuple[dict[tuple[int, int], float], Dynamics | None, Coverage | None, float]


def learned_usage(target: str | None, g: Geometry) -> Learned:
    """The store's learned usage ((block, expert) → routes) where earlier runs taught it at
    least ``MIN_USAGE_TOKENS`` tokens, else {}; their decode dynamics (``learned_dynamics``)
    and prompt coverage (``learned_coverage``), or None; the tokens it was learned from."""
    if not target or not os.path.isdir(target):
        return {}, None, None, 0.0
    from ...store.reader import Store
    try:
        with Store.open(target) as st:
            usage = {(int(la), int(e)): float(c) for (la, e), c in st.index.usage().items()}
            counters = st.index.usage_dynamics()
    except Exception:                  # an index without a usage table (older stores): the presets
        return {}, None, None, 0.0
    coverage = learned_coverage(g, counters)
    tokens = usage_tokens(g, usage, counters)
    if tokens < MIN_USAGE_TOKENS:
        return {}, None, coverage, 0.0
    return usage, learned_dynamics(g, counters, usage), coverage, tokens


class Replays:
    """The routing replays of one plan, each built once for the hit rates and the first token:
    ``trace``, ``usage:PRESET`` (the learned usage, the preset's dynamics) or a preset."""

    def __init__(self, g: Geometry, req: PlanRequest, learned: Learned,
                 say: Callable[[str], None]) -> None:
        self.g, self.req, self.say = g, req, say
        self.usage, self.dynamics, self.coverage, self.tokens = learned
        self._built: dict[str, Any] = {}

    def get(self, spec: str) -> Any:
        if spec not in self._built:
            g, req = self.g, self.req
            if spec == "trace":
                self.say("reading the trace")
                self._built[spec] = trace_replay(g, req.trace)
            elif spec.startswith("usage:"):
                self._built[spec] = usage_replay(g, self.usage, spec[6:], tokens=req.tokens,
                                                 seed=req.seed, dynamics=self.dynamics)
            else:
                self._built[spec] = synthetic_replay(g, spec, tokens=req.tokens, seed=req.seed)
        return self._built[spec]


def routing_specs(req: PlanRequest, usage: dict[tuple[int, int], float]) -> list[str]:
    """(slow, fast end) replays: the trace, else the presets (on the learned usage; NEW_REQUEST)."""
    if req.trace:
        return ["trace", "trace"]
    specs = list(req.synthetic) * (2 if len(req.synthetic) == 1 else 1)
    return ["usage:" + specs[0] + NEW_REQUEST, "usage:" + specs[1]] if usage else specs


def simulator_routing(g: Geometry, req: PlanRequest, say: Callable[[str], None],
                      replays: Replays) -> RoutingFor:
    """Hit rates from the cache simulator on ``replays`` (the trace, else the store's learned
    usage, else the synthetic presets), cached per tier sizes so placements with the same tiers
    replay once; each end with the share of the experts its replay's prompt touches
    (``prompt_cover``)."""
    done: dict[tuple, RoutingRange] = {}
    covers: dict[str, float] = {}
    usage = replays.usage
    specs = routing_specs(req, usage)
    replay = replays.get

    def label(spec: str) -> str:
        if spec == "trace":
            return f"trace {req.trace}"
        if spec.startswith("usage:"):
            dyn, preset = replays.dynamics, spec[6:].removesuffix(NEW_REQUEST)
            new = ", a request unlike them" if spec.endswith(NEW_REQUEST) else ""
            return (f"this store's learned usage ({replays.tokens:.0f} tokens of earlier "
                    f"runs{new}), '{preset}' dynamics"
                    + (f" in the prompt, {dyn.describe()}" if dyn is not None else ""))
        return f"synthetic '{spec}'"

    def prompt_cover(spec: str) -> float:
        """The share of the experts the replay's first ``--prompt-tokens`` tokens touch (the
        store's prompts' learned coverage where counted)."""
        if spec not in covers:
            from .prefill import touched_per_layer
            n = max(0, req.prompt_tokens)
            covers[spec] = (touched_per_layer(g, n, replay(spec), replays.coverage) / g.n_experts
                            if n and g.n_experts else 0.0)
        return covers[spec]

    def routing_for(mem: Memory) -> RoutingRange:
        v, r = mem.tier_slots
        on_gpu = mem.placement.experts == "gpu"
        key = (v, r, on_gpu)
        if key not in done:
            ends = {}
            for spec in dict.fromkeys(specs):
                say(f"simulating the cache ({spec}) at {v} VRAM + {r} RAM experts")
                rt = route(g, replay(spec), v, r, experts_on_gpu=on_gpu, label=label(spec),
                           synthetic=not (spec == "trace" or spec.startswith("usage:")),
                           policy=req.policy)
                ends[spec] = replace(rt, prompt_cover=prompt_cover(spec))
            done[key] = RoutingRange(ends[specs[0]], ends[specs[1]])
        return done[key]

    return routing_for


def run_plan(req: PlanRequest, progress: Callable[[str], None] | None = None) -> Plan:
    say = progress or (lambda msg: None)
    if req.tokens < 8:
        raise UsageError(f"--tokens {req.tokens}", fix="give --tokens 8 or more")
    if not req.synthetic or len(req.synthetic) > 2:
        raise UsageError("--synthetic takes one or two presets", fix="e.g. --synthetic diffuse,mixed")
    if req.io_profile and req.disk_gbps:
        raise UsageError("--io-profile and --disk-gbps both describe the drive", fix="give one")
    drive = stated_drive(req.disk_gbps) if req.disk_gbps else None
    say("reading the model")
    g, data_path = load_geometry(req.target, req.model, req.source)
    box = _box(req, g.n_ctx_train, store_page_cache(data_path))
    mems = candidates(g, box, req.placement, req.trunk)
    forced = req.placement != "auto" and req.trunk != "auto"
    if not any(m.runnable for m in mems):
        return make_plan(g, box, [Option(m) for m in mems], None, forced=forced)

    # --- rates -----------------------------------------------------------------------------
    detail: dict[str, Any] = {}
    if drive is not None:
        storage = drive
    elif req.io_profile:
        storage, detail["storage"] = read_io_profile(req.io_profile, g.k)
    elif data_path and os.path.isfile(data_path) and (req.probe or req.use_cache):
        storage, detail["storage"] = _storage(req, g, data_path, say)
    else:
        storage = stated_storage()
    runnable = [m for m in mems if m.runnable]
    expert_mats = [m for layer in g.expert_parts for m in layer]

    def mats_on(dev: str) -> list:
        out = list(expert_mats) if any(m.placement.experts == dev for m in runnable) else []
        for m in runnable:
            if m.placement.trunk == dev:
                out += g.trunk_compute(m.placement.trunk_mode, dev)
        return out

    types = sorted({m.ggml_type for m in expert_mats} | {m.ggml_type for m in g.trunk_matrices})
    cpu = stated_cpu()
    cpu_mats = mats_on("cpu")
    if cpu_mats and (req.probe or req.use_cache):
        from .boxcache import cpu_rates
        say("measuring the CPU kernels" if req.probe else "reading cached rates")
        cpu, detail["cpu"] = cpu_rates(g, cpu_mats, probe=req.probe, act_quant=req.act_quant,
                                       tiny=req.tiny_store)
    gpu_mem = None
    if req.gpu_gbps is not None:
        if req.gpu_gbps <= 0:
            raise UsageError(f"--gpu-bw {req.gpu_gbps}", fix="give the GPU's memory bandwidth in GB/s")
        gpu_mem = Range(STATED_SLOW * req.gpu_gbps, req.gpu_gbps,
                        f"--gpu-bw {req.gpu_gbps:g} GB/s (slow end {STATED_SLOW:g}x)")
    gpu = stated_gpu(types, gpu_mem)
    pcie = stated_pcie(req.pcie_gen)
    gpu_mats = mats_on("gpu")
    if req.probe and gpu_mats and req.gpu_gbps is None and _cuda():
        from .probe import probe_cuda
        say("measuring the GPU")
        try:
            got = probe_cuda(gpu_mats, g)
        except Exception as e:                 # out of memory, a driver error: stated figures
            got = None
            detail["gpu"] = {"error": f"{type(e).__name__}: {e}", "used": "stated defaults"}
        if got is not None:
            gpu, pcie, detail["gpu"] = got
    from .boxcache import verify_rate
    rates = Rates(storage, pcie, cpu, gpu, read_cpu_from(detail.get("storage"), storage.source),
                  verify_rate(probe=req.probe),
                  miss_cpu_from(detail.get("storage"), storage.source))
    from .paths import compute_paths
    detail["compute_paths"] = compute_paths(g, req.act_quant)

    # --- routing and the choice ------------------------------------------------------------
    replays = Replays(g, req, learned_usage(None if req.trace else req.target, g), say)
    routing_for = simulator_routing(g, req, say, replays)
    options = plan_options(g, box, rates, routing_for, mems=mems)
    plan = make_plan(g, box, options, rates, probes=detail, forced=forced)
    return _with_first_token(plan, req, g, say, replays)


def _with_first_token(plan: Plan, req: PlanRequest, g: Geometry, say, replays: Replays
                      ) -> Plan:
    """The plan with its first token's time (``plan.prefill``) where it runs on the CPU, on
    the routing's replays (reused): the fast end's, and the slow end's where it was measured
    (the trace or the learned usage; uniform routing otherwise)."""
    m = plan.memory
    if not m.runnable or plan.rates is None or m.placement.where != "cpu" or req.prompt_tokens < 1:
        return plan
    from .boxcache import dequant_rates, gemm_rate, panel_rates
    from .native import wide_limits
    from .prefill import WidePath, first_token
    say("predicting the first token")
    slow, fast = routing_specs(req, replays.usage)
    replay = replays.get(fast)
    measured = slow == "trace" or slow.startswith("usage:")
    slow_replay = replays.get(slow) if measured else None
    types = sorted({t.ggml_type for t in g.trunk_matrices})
    limits = wide_limits(types, req.act_quant)
    panel = panel_rates(types, probe=req.probe, act_quant=req.act_quant)
    deq = dequant_rates([t for t in types if t not in panel], probe=req.probe)
    drive = drive_share(g, m, plan.box.page_cache)
    ft = first_token(g, plan.rates, sum(m.tier_slots), req.prompt_tokens,
                     gemm_rate(probe=req.probe), replay,
                     wide={t: WidePath(limits[t], panel.get(t), deq.get(t))
                           for t in types if t in limits and (t in panel or t in deq)},
                     slow_replay=slow_replay, trunk_reread=trunk_reread_bytes(m),
                     drive=drive, verify=plan.rates.verify,
                     fresh_slots=window_spare(g, m, drive) or None, coverage=replays.coverage)
    return replace(plan, first_token=ft)


_READ_CPU = ("cpu_s_per_gb", "cpu_s_per_gb_slow", "cpu_fresh",    # the probe's CPU figures
             "cpu_s_per_gb_reused", "cpu_s_per_gb_reused_slow")   # a cached drive keeps


def _storage(req: PlanRequest, g: Geometry, data_path: str, say) -> tuple[Range, dict[str, Any]]:
    """The drive at the engine's pattern: this device's cached figure, else measured now
    (with ``probe``) and cached, else the stated default; either way widened to the drive's
    storage checks of the last day (with ``probe``, one more now: a short point, under a
    second)."""
    from . import boxcache
    data, key = boxcache.load(), boxcache.storage_key(data_path, g.slot_bytes)
    hit, checks = data.get(key), "checks|" + key
    store = os.path.dirname(data_path) if req.target and os.path.isdir(req.target) else None
    if isinstance(hit, dict) and "slow" in hit and (hit.get("backend") or not req.probe):
        rng = Range(float(hit["slow"]), float(hit["fast"]),
                    "measured earlier on this device: " + str(hit.get("source", "")))
        detail = {"cache": key, **{f: hit.get(f) for f in _READ_CPU}}
        if req.probe and hit.get("slow_qd"):             # (a probing plan's hit has a backend)
            from .storage_probe import storage_check
            try:
                now = storage_check(data_path, g.slot_bytes, str(hit["backend"]),
                                    int(hit["slow_qd"]), store_path=store)
            except Exception as e:                   # the cached figure stands
                detail["check_error"] = str(e)
            else:
                data[checks] = boxcache.recent_checks(data.get(checks), now)
                boxcache.save(data)
        return boxcache.storage_spread(rng, data.get(checks)), detail
    if not req.probe:
        return stated_storage(), {}
    from .storage_probe import probe_storage
    say("measuring storage")
    rng, detail = probe_storage(data_path, g.k, g.slot_bytes, store_path=store)
    data[key] = {**rng.as_dict(), **{f: detail.get(f) for f in _READ_CPU},
                 "backend": detail.get("backend"), "slow_qd": detail.get("slow_qd")}
    data[checks] = boxcache.recent_checks(data.get(checks), rng.slow)
    boxcache.save(data)
    return rng, detail


def _cuda() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False
