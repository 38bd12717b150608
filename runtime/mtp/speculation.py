"""``attach(engine, MTPOptions(...))``: MTP speculative decoding, draft-route prefetch and the
route tail skip built on top of an open ``Engine``.

The engine knows nothing of them. ``attach`` installs the router hook through
``runner.set_router``; the ``Speculator`` registers itself with ``engine.add_observer`` (the
trunk's hidden states of every forward, every reset) and runs its verify passes through
``engine.verify``. What it returns, a ``Speculation``, is for the caller: ``generate`` and the
server's ``Session`` take its ``speculator``, and its ``report()`` is what the CLI adds to
``engine.stats()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from ...errors import UsageError
from .nextn import NextN, nextn_block
from .routing import RouterHook, resident_fn
from .speculative import Speculator

__all__ = ["MTPOptions", "Speculation", "attach"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MTPOptions:
    mtp: int | str = 0                    # MTP draft depth (0 = off) or "auto" (utility gate)
    mtp_max: int = 4                      # deepest draft "auto" may choose
    draft_prefetch: bool = False          # prefetch every layer's predicted verify experts
    route_tail_skip: int = 0              # opt-in lossy: skip cold experts ranked past N

    @property
    def active(self) -> bool:
        return bool(self.mtp or self.draft_prefetch or self.route_tail_skip)

    def engine_options(self, options: Any) -> Any:
        """``options`` (``EngineOptions``) as an engine for these options opens with: draft-route
        prefetch reads a whole verify pass ahead, into the cache itself, so the lookahead gets
        no prefetch slots outside the tier (the tiers give those only to a RAM-only cache)."""
        return replace(options, prefetch_slots=0) if self.draft_prefetch else options

    def replace(self, **kw: Any) -> MTPOptions:
        return replace(self, **kw)


@dataclass
class Speculation:
    """What ``attach`` built on an engine: the router hook, and the speculator when MTP drafts
    (None with the route tail skip alone: plain decoding, its windows skipped)."""

    engine: Any
    routing: RouterHook
    speculator: Speculator | None = None

    def report(self) -> dict[str, Any]:
        """The ``"mtp"`` and ``"route_tail_skip"`` figures, for ``engine.stats()``."""
        out: dict[str, Any] = {}
        spec = self.speculator
        if spec is not None:
            m = spec.stats.as_dict()
            if spec.gate is not None:
                m["gate"] = spec.gate.as_dict()
            if spec.draft_prefetcher is not None:
                m["draft_prefetch"] = spec.draft_prefetcher.as_dict()
            out["mtp"] = m
        hook = self.routing
        if hook.skip_n:
            out["route_tail_skip"] = dict(hook.skip.as_dict(), n=hook.skip_n)
        return out


def _router_hook(engine: Any, skip_n: int) -> RouterHook:
    t, runner = engine.trunk, engine.runner
    layer_of = {id(b.moe.router): b.layer for b in t.blocks + t.nextn if b.moe is not None}
    trunk_moe = {b.layer for b in t.blocks if b.moe is not None}
    store = engine.store

    def nbytes(layer: int, e: int) -> int:
        return int(store.extent(layer, e).length)
    hook = RouterHook(runner.router, layer_of, skip_n=skip_n,
                      resident=resident_fn(engine.provider, runner.dq),
                      skip_layers=trunk_moe, expert_bytes=nbytes,
                      in_window=lambda: runner.decoding)
    runner.set_router(hook)
    return hook


def attach(engine: Any, options: MTPOptions) -> Speculation | None:
    """Build what ``options`` ask for on ``engine`` (None when they ask for nothing): the router
    hook, the speculator, the gate and the draft-route prefetcher. Once per engine, before its
    first forward (the speculator keeps the trunk's hidden states from then on); an engine
    opened for them takes ``options.engine_options(...)``."""
    o = options
    if o.route_tail_skip < 0:
        raise UsageError(f"--route-tail-skip {o.route_tail_skip}", fix="use N >= 1 (0 = off)")
    if not o.active:
        return None
    hook = _router_hook(engine, o.route_tail_skip)
    if not o.mtp:
        if o.draft_prefetch:
            raise UsageError("draft-route prefetch needs MTP drafts", fix="add --mtp K or auto")
        return Speculation(engine, hook)
    blk = nextn_block(engine.model) if engine.options.load_nextn else None
    if blk is None:
        if o.mtp == "auto" and not o.draft_prefetch:
            # auto picks the depth, 0 included: a store without a draft block decodes plainly,
            # so one command line serves every model
            log.warning("--mtp auto: %s has no NextN/MTP block; decoding without drafts",
                        engine.store.path)
            return Speculation(engine, hook)
        raise UsageError("--mtp: this store has no NextN/MTP block",
                         fix="run without --mtp, or with --mtp auto (GLM-4.5 and GLM-5 stores "
                             "carry one)")
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
    spec = Speculator(engine, NextN(engine.model, blk, engine.options.n_ctx), depth)
    if o.draft_prefetch:
        from .draftroute import DraftRoutePrefetcher
        DraftRoutePrefetcher(engine).install(spec, hook)
    return Speculation(engine, hook, spec)
