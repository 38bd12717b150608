"""The tiers ``expertfs run`` (and ``serve``) size when not told: the RAM tier from the memory
limit (``runtime.plan.host.run_host_budget``) and, on CUDA without ``--vram``, the VRAM tier
from free device memory (``runtime.cache.vram.plan_vram``)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from ._common import mtp_arg

__all__ = ["lookahead_choice", "ram_and_lookahead", "vram_tier"]

log = logging.getLogger("expertfs.cli.run")


def _log_paths(g, device: str, fused: str, act_quant: str = "off") -> None:
    """One line per ggml type that falls back to torch dequantization (WARNING for expert
    tensors, INFO for the trunk's), and every type's path at INFO; with ``--act-quant q8`` on
    the CPU, which types' prompt products take the 8-bit integer panel and which keep the
    exact float one; else which run on AMX where the CPU has it."""
    from ..runtime.plan.paths import describe_paths, prompt_paths
    summary, slow = describe_paths(g, device, fused != "off")
    log.info("compute paths on %s: %s", device, summary)
    for t, role in slow:
        (log.warning if role == "experts" else log.info)(
            "%s tensors of type %s have no native kernel here: they run through torch "
            "dequantization (far slower)", role, t)
    if device == "cpu" and (line := prompt_paths(g, act_quant)):
        log.info("%s", line)


def ram_and_lookahead(args: argparse.Namespace, device: str,
                      fused: str = "auto") -> tuple[int, dict[str, object]]:
    """``(ram_tier, the lookahead's EngineOptions)`` from one reading of the store."""
    ram, g, trunk_resident = _sized(args, device, fused)
    return ram, lookahead_choice(args, ram, g, trunk_resident)


def _sized(args: argparse.Namespace, device: str, fused: str) -> tuple[int, object, bool]:
    """``(ram, geometry, trunk resident)``. The RAM tier: ``--ram``, or the default ``expertfs
    plan`` reports for this box: what the memory limit (a cgroup cap or
    ``EXPERTFS_MEMORY_LIMIT`` counts) leaves beside the OS headroom, the runtime, the trunk, the
    KV cache at ``--ctx`` (on the CPU it is host memory) and the workspace, a prompt batch
    included (``--batch``, or ``args.prompt_tokens``, ``run``'s prompt, where shorter:
    ``runtime.plan.host.budget_batch``, ``run_host_budget``), or the fallback tier where that
    is less than the run needs (``HostBudget.default_tier``); a budget that would push the
    trunk out of memory is warned about. The trunk counts as resident where the budget leaves
    a route's room beside it (else it is re-read every token)."""
    from ..runtime.plan.host import PREFILL_BATCH, budget_batch, run_host_budget
    from ..runtime.plan.model import geometry_of_store
    from ..runtime.plan.paths import kept_types
    from ..store.reader import Store
    kv_type = "bf16" if getattr(args, "dtype", "auto") in ("bfloat16", "bf16") else "f32"
    on = "cpu" if device == "cpu" else "gpu"
    with Store.open(args.store) as s:    # a NextN block loaded only to draft (run --mtp)
        g = replace(geometry_of_store(s), nextn_loaded=bool(mtp_arg(getattr(args, "mtp", "0"))))
    _log_paths(g, device, fused, getattr(args, "act_quant", "off"))
    if args.vram is None:
        args.vram = vram_tier(args, device, g) if on == "gpu" else 0
    vram_experts = (args.vram // g.slot_bytes) if on == "gpu" else 0
    budget = run_host_budget(g, args.ctx, on, args.trunk, kv_type=kv_type if on == "cpu" else None,
                             kept_types=kept_types(device, fused != "off"),
                             vram_tier_experts=vram_experts,
                             batch=budget_batch(getattr(args, "prompt_tokens", 0),
                                                getattr(args, "batch", PREFILL_BATCH)))
    need = g.k if on == "cpu" or not vram_experts else 1       # experts the tier must hold
    ram = args.ram if args.ram is not None else budget.default_tier(g.slot_bytes, g.k, need)
    # a tier that leaves the trunk short: the engine measures what is really out and streams
    # it a layer ahead where the page cache would re-read more (model.trunk_stream)
    args.trunk_short = on == "cpu" and ram > budget.room
    warning = budget.warning(ram, need * g.slot_bytes)
    if warning:
        print(f"expertfs {args.command}: warning: {warning}", file=sys.stderr)
    return ram, g, budget.room >= g.k * g.slot_bytes


def vram_tier(args: argparse.Namespace, device: str, g) -> int:
    """The default VRAM tier on CUDA (``runtime.cache.vram.plan_vram``), kept in
    ``args.vram_plan`` for the JSON summary. The workspace holds k experts dequantized at once
    (a group's, ``runtime.model.expert_groups``) and ``--dq-cache``, which lives on the device."""
    from ..runtime.cache.vram import plan_vram
    from ..runtime.plan.geometry import kv_cache_bytes
    from ..runtime.plan.host import workspace_bytes
    el = 4 if getattr(args, "dtype", "auto") in ("float32", "fp32", "f32") else 2
    per_expert = max((sum(m.elements for m in layer) for layer in g.expert_parts), default=0)
    plan = plan_vram(trunk=g.trunk_resident("quant" if args.trunk == "quant" else "float", el),
                     kv=kv_cache_bytes(g, args.ctx, "f32" if el == 4 else "bf16"),
                     workspace=workspace_bytes(g, args.ctx, "gpu") + g.k * per_expert * (4 + el)
                     + (getattr(args, "dq_cache", 0) or 0),
                     experts=g.slot_bytes * g.n_decode_experts, min_tier=g.k * g.slot_bytes,
                     device=device)
    args.vram_plan = {**vars(plan), "tier": plan.tier}
    return plan.tier


def lookahead_choice(args: argparse.Namespace, ram: int, g, trunk_resident: bool
                     ) -> dict[str, object]:
    """The lookahead's ``EngineOptions`` (``lookahead``, ``lookahead_margin``,
    ``lookahead_tune``) for ``args.lookahead``: ``on`` (``--lookahead``) and ``off``
    (``--no-lookahead``) as asked; ``auto`` (the default; ``serve``'s always) as
    ``runtime.prefetch.lookahead.auto_lookahead`` decides for a RAM tier of ``ram`` (on where
    the experts stream on the architectures where it was measured to pay, tuned in decode
    elsewhere they stream, else off); with ``AUTO_MARGIN`` unless ``--lookahead-margin`` is
    given (else ``MARGIN``)."""
    from ..runtime.prefetch.lookahead import AUTO_MARGIN, MARGIN, auto_lookahead
    mode = getattr(args, "lookahead", "auto")
    margin = getattr(args, "lookahead_margin", None)
    if mode in ("on", "off"):
        return {"lookahead": mode == "on", "lookahead_margin": MARGIN if margin is None else margin}
    auto = auto_lookahead(g.arch, ram // max(1, g.slot_bytes), g.n_decode_experts,
                          bool(args.vram), trunk_resident)
    if auto != "off":
        log.info("lookahead %s (%s streams its experts)",
                 "on" if auto == "on" else "tuned in decode", g.arch)
    return {"lookahead": auto != "off",
            "lookahead_margin": AUTO_MARGIN if margin is None else margin,
            "lookahead_tune": auto == "tuned"}


def lookahead_line(la: dict) -> str:
    """``run``'s line on the lookahead: what its reads covered and, tuned, what it kept."""
    tried = (f"; kept {'on' if la['tuned_on'] else 'off'} ({la['ms_on']:.0f} ms a token with "
             f"it, {la['ms_off']:.0f} without)" if la.get("trials") else
             "; not tried: too short a decode to repay a trial" if la.get("pending") else "")
    return (f"lookahead: coverage {100 * la['coverage']:.0f}%, waste {100 * la['waste']:.0f}%"
            + tried)
