"""``expertfs plan`` end to end: inputs → geometry → budget → rates → routing → ``plan.Plan``.

``run_plan(PlanRequest(...))`` is what the CLI calls; it prints nothing. Measurements run only
where the plan needs them (the CPU probe when something computes on the CPU, the GPU probe when
this machine has CUDA and the plan uses a GPU, the storage probe when a store or GGUF is given
without ``io_profile``); ``probe=False`` uses the stated defaults everywhere (deterministic).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from .plan import (Box, Plan, Range, Rates, RoutingRange, make_plan, plan_memory, stated_cpu,
                   stated_gpu, stated_pcie, stated_storage, storage_from_profile)
from .plan_model import load_geometry
from .plan_routing import DEFAULT_SYNTHETIC, DEFAULT_TOKENS, route, synthetic_replay, trace_replay
from .policies_registry import DEFAULT_POLICY

__all__ = ["PlanRequest", "run_plan", "read_io_profile"]


@dataclass(frozen=True)
class PlanRequest:
    target: str | None = None              # a store folder or a .gguf
    like: str | None = None                # or a preset name
    quant: str = "default"                 # --like's quant spec
    ram: int | None = None                 # None: this machine's
    vram: int | None = None                # None: this machine's first CUDA device, else 0
    ctx: int | None = None                 # None: 8192, or the training context if shorter
    kv_type: str = "f16"
    headroom: int | None = None
    pinned_cap: float = 0.5
    io_profile: str | None = None
    trace: str | None = None
    synthetic: tuple[str, ...] = DEFAULT_SYNTHETIC
    policy: str = DEFAULT_POLICY
    tokens: int = DEFAULT_TOKENS
    seed: int = 0
    probe: bool = True
    pcie_gen: int = 4
    gpu_gbps: float | None = None          # stated GPU memory bandwidth (fast end; slow = 0.6x)


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


def _box(req: PlanRequest, n_ctx_train: int) -> Box:
    from .plan_probe import cuda_memory, host_memory

    here = []
    ram = req.ram
    if ram is None:
        ram = host_memory()
        here.append("RAM")
    vram = req.vram
    if vram is None:
        vram = cuda_memory()
        here.append("VRAM")
    label = ("this machine's " + " and ".join(here)) if here else "as given"
    ctx = req.ctx if req.ctx is not None else min(8192, n_ctx_train or 8192)
    return Box(ram, vram, ctx, req.kv_type, req.headroom, req.pinned_cap, label)


def run_plan(req: PlanRequest, progress: Callable[[str], None] | None = None) -> Plan:
    say = progress or (lambda msg: None)
    if req.tokens < 8:
        raise UsageError(f"--tokens {req.tokens}", fix="give --tokens 8 or more")
    if not req.synthetic or len(req.synthetic) > 2:
        raise UsageError("--synthetic takes one or two presets", fix="e.g. --synthetic diffuse,mixed")
    say("reading the model")
    g, data_path = load_geometry(req.target, req.like, req.quant)
    box = _box(req, g.n_ctx_train)
    mem = plan_memory(g, box)
    if not mem.runnable:
        return make_plan(g, box, mem, None, None)
    pl = mem.placement

    # --- rates -----------------------------------------------------------------------------
    detail: dict[str, Any] = {}
    if req.io_profile:
        storage, detail["storage"] = read_io_profile(req.io_profile, g.k)
    elif req.probe and data_path and os.path.isfile(data_path):
        from .plan_probe import probe_storage
        say("measuring storage")
        store = os.path.dirname(data_path) if req.target and os.path.isdir(req.target) else None
        storage, detail["storage"] = probe_storage(data_path, g.k, g.slot_bytes, store_path=store)
    else:
        storage = stated_storage()
    mats = [m for layer in g.expert_parts for m in layer] + list(g.trunk_matrices)
    types = sorted({m.ggml_type for m in mats})
    cpu = stated_cpu()
    if req.probe and "cpu" in (pl.trunk, pl.experts):
        from .plan_probe import probe_cpu
        say("measuring CPU dequant+matmul")
        cpu_mats = ([m for layer in g.expert_parts for m in layer] if pl.experts == "cpu" else []) \
            + (list(g.trunk_matrices) if pl.trunk == "cpu" else [])
        cpu, detail["cpu"] = probe_cpu(cpu_mats)
    gpu_mem = None
    if req.gpu_gbps is not None:
        if req.gpu_gbps <= 0:
            raise UsageError(f"--gpu-bw {req.gpu_gbps}", fix="give the GPU's memory bandwidth in GB/s")
        gpu_mem = Range(0.6 * req.gpu_gbps, req.gpu_gbps, f"--gpu-bw {req.gpu_gbps:g} GB/s "
                        "(slow end 0.6x)")
    gpu = stated_gpu(types, gpu_mem)
    pcie = stated_pcie(req.pcie_gen)
    if req.probe and pl.gpu and req.gpu_gbps is None:
        from .plan_probe import probe_cuda
        got = probe_cuda(mats) if _cuda() else None
        if got is not None:
            say("measuring the GPU")
            gpu, pcie, detail["gpu"] = got
    rates = Rates(storage, pcie, cpu, gpu)

    # --- routing ---------------------------------------------------------------------------
    vslots, rslots = mem.tier_slots
    on_gpu = pl.experts == "gpu"
    if req.trace:
        say("replaying the trace")
        rp = trace_replay(g, req.trace)
        r = route(g, rp, vslots, rslots, experts_on_gpu=on_gpu, label=f"trace {req.trace}",
                  synthetic=False, policy=req.policy)
        routing = RoutingRange(r, r)
    else:
        specs = list(req.synthetic) * (2 if len(req.synthetic) == 1 else 1)
        done: dict[str, Any] = {}
        for spec in specs:
            if spec not in done:
                say(f"simulating the cache on synthetic routing {spec!r}")
                rp = synthetic_replay(g, spec, tokens=req.tokens, seed=req.seed)
                done[spec] = route(g, rp, vslots, rslots, experts_on_gpu=on_gpu,
                                   label=f"synthetic '{spec}'", synthetic=True, policy=req.policy)
        routing = RoutingRange(done[specs[0]], done[specs[1]])
    return make_plan(g, box, mem, rates, routing, probes=detail)


def _cuda() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False
