"""MTP speculative decoding with the model's own NextN block, draft-route expert prefetch, and
the opt-in route tail skip. One concept per module:

``nextn``       the NextN block's forward (llama.cpp's ``graph_mtp``), its own KV cache
``accept``      the acceptance rules: greedy exact match, speculative sampling
``speculative`` ``Speculator``: catch-up, draft, verify, accept, roll back
``gate``        ``UtilityGate``: draft depth from measured acceptance and step costs
``routing``     ``RouterHook``: routing taps and ``--route-tail-skip``
``draftroute``  every layer's verify experts predicted from the drafts, prefetched for the step
``evaluate``    acceptance tables, predictor coverage/waste, tail-skip quality (offline)

``attach(engine)`` wires them into an ``Engine`` from its options (``Engine`` calls it);
``report(engine)`` is what ``Engine.stats()`` adds.
"""

from __future__ import annotations

from typing import Any

from ...errors import UsageError
from .nextn import NextN, nextn_block
from .routing import RouterHook, resident_fn
from .speculative import DraftState, Speculator, SpecStats

__all__ = ["attach", "report", "NextN", "Speculator", "SpecStats", "DraftState", "RouterHook"]


def _router_hook(engine: Any) -> RouterHook:
    if engine.routing is None:
        t = engine.trunk
        layer_of = {id(b.moe.router): b.layer for b in t.blocks + t.nextn if b.moe is not None}
        trunk_moe = {b.layer for b in t.blocks if b.moe is not None}
        store = engine.store

        def nbytes(layer: int, e: int) -> int:
            return int(store.extent(layer, e).length)
        hook = RouterHook(engine.runner.router, layer_of,
                          skip_n=engine.options.route_tail_skip,
                          resident=resident_fn(engine.provider, engine.runner.dq),
                          skip_layers=trunk_moe, expert_bytes=nbytes)
        engine.runner.router = hook
        engine.routing = hook
    return engine.routing


def attach(engine: Any) -> None:
    """Build what ``engine.options`` asks for: the router hook, the speculator, the gate and
    the draft-route prefetcher."""
    o = engine.options
    if o.route_tail_skip < 0:
        raise UsageError(f"--route-tail-skip {o.route_tail_skip}", fix="use N >= 1 (0 = off)")
    _router_hook(engine)
    if not o.mtp:
        if o.draft_prefetch:
            raise UsageError("draft-route prefetch needs MTP drafts", fix="add --mtp K or auto")
        return
    blk = nextn_block(engine.model) if o.load_nextn else None
    if blk is None:
        raise UsageError("--mtp: this store has no NextN/MTP block",
                         fix="run without --mtp (GLM-4.5-class glm4moe stores carry one)")
    if o.mtp == "auto":
        from .gate import UtilityGate
        depth: Any = UtilityGate(max_depth=max(1, o.mtp_max))
    else:
        try:
            depth = int(o.mtp)
        except (TypeError, ValueError):
            raise UsageError(f"--mtp {o.mtp!r}", fix="give a draft depth (1..8) or auto") from None
        if not 0 < depth <= 16:
            raise UsageError(f"--mtp {depth}", fix="give a draft depth of 1..16, or auto")
    spec = Speculator(engine, NextN(engine.model, blk, o.n_ctx), depth)
    engine.spec = spec
    if o.draft_prefetch:
        from .draftroute import DraftRoutePrefetcher
        DraftRoutePrefetcher(engine).install(spec)


def report(engine: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    spec = engine.spec
    if spec is not None:
        m = spec.stats.as_dict()
        if spec.gate is not None:
            m["gate"] = spec.gate.as_dict()
        pf = getattr(spec, "draft_prefetcher", None)
        if pf is not None:
            m["draft_prefetch"] = pf.as_dict()
        out["mtp"] = m
    hook = engine.routing
    if hook is not None and hook.skip_n:
        out["route_tail_skip"] = dict(hook.skip.as_dict(), n=hook.skip_n)
    return out
