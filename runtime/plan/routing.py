"""Hit rates at the planned tier sizes: the cache simulator replayed on a routing trace.

A real trace (``--trace``, recorded against this model) is replayed as it is. Without one, a
store that earlier runs taught its usage (the LMDB table ``run`` adds its routes to) gives the
popularity of every expert: a trace is drawn from it (``usage_replay``: each layer's fresh picks
in proportion to its learned counts, the experts never chosen sharing the Good–Turing estimate
of the routes they would get at the fast end, a route each at the slow end: ``_popularity``)
with a preset's token-to-token dynamics (stickiness, cross-layer links), and, where the runs
also counted how their decode kept and reused experts (``learned_dynamics``), those dynamics
for the tokens after the first quarter. Otherwise a synthetic trace of the model's geometry is
generated from a preset of ``trace.synth`` and the result is labelled synthetic. Either way the
first quarter of the tokens only teaches the usage table (as the store's learned usage warms a
real run's caches; experts it never saw rank last) and the rest is replayed from that warm
start, so the rates are steady-state decode, not the cold first tokens. Tiers are exclusive
(``simulate``'s default); slots hold the model's largest extent and every miss reads that
layer's extent bytes.
"""

from __future__ import annotations

import dataclasses
import os

from ...errors import UsageError
from .coldstart import distinct_experts
from .geometry import Geometry
from .predict import Routing, RoutingRange
from ..policies.base import CapacityError, usage_rates
from ..policies.registry import DEFAULT_POLICY, make_factory
from ..sim.replay import Replay, simulate, usage_counts
from ..trace.file import TraceHeader
from ..trace.synth import PRESETS, parse_spec, synthetic_chunks, synthetic_header

__all__ = ["DEFAULT_SYNTHETIC", "DEFAULT_TOKENS", "UNSEEN_ROUTES", "NEW_REQUEST",
           "MIN_USAGE_TOKENS", "MIN_DYNAMICS_TOKENS", "Dynamics", "learned_dynamics", "Coverage",
           "learned_coverage", "synthetic_replay", "usage_replay", "usage_tokens", "trace_replay",
           "route", "ideal_routing"]

#: (slow end, fast end) presets when no trace is given: spread-out routing with little reuse,
#: and skewed, sticky routing whose layers differ (see trace.synth.PRESETS)
DEFAULT_SYNTHETIC = ("diffuse", "mixed")
DEFAULT_TOKENS = 256
#: the fewest routes a layer's never-chosen experts share (``_popularity``): they keep a chance
#: even where no expert was chosen exactly once
UNSEEN_ROUTES = 1.0
#: the slow end's usage replay (``usage:PRESET`` + this): a request unlike those the store
#: learned, whose experts the learned counts foretell less: every expert a route of prior
NEW_REQUEST = "+new"
#: fewer learned tokens than this (per MoE layer, on average) and the presets are used instead
MIN_USAGE_TOKENS = 64
#: fewer decoded tokens than this in the runs' counters and the presets' dynamics are used: a
#: run of 16 tokens, or two short ones (``_beyond`` already discounts what so few routes cannot
#: tell from chance, where the presets' far less sticky decode priced far more misses than two
#: such runs of a capped qwen3moe had: bench/README.md, plan's learned routing)
MIN_DYNAMICS_TOKENS = 16


def synthetic_replay(g: Geometry, spec: str, *, tokens: int = DEFAULT_TOKENS, seed: int = 0) -> Replay:
    """A synthetic trace with the model's MoE layers, experts, top-k and extent sizes."""
    name = spec.split(",", 1)[0].strip()
    if "=" not in name and name not in PRESETS:
        raise UsageError(f"unknown synthetic routing preset {name!r}",
                         fix=f"use one of {', '.join(PRESETS)}")
    s = parse_spec(spec, n_layers=len(g.moe_layers), n_experts=g.n_experts, k=g.k,
                   n_tokens=tokens, expert_bytes=g.slot_bytes, seed=seed)
    if (s.n_layers, s.n_experts, s.k) != (len(g.moe_layers), g.n_experts, g.k):
        raise UsageError(f"synthetic routing {spec!r} changes the model's geometry",
                         fix="give a preset and fields other than n_layers, n_experts, k")
    header = dataclasses.replace(synthetic_header(s), expert_bytes=g.extent_bytes)
    return Replay.from_chunks(header, synthetic_chunks(s))


def usage_tokens(g: Geometry, usage: dict[tuple[int, int], float],
                 counters: dict[str, int] | None = None) -> float:
    """Tokens the usage table has seen, per MoE layer on average: a layer's counts / k, or
    where the runs' counters (``runtime.cache.usage``) say more, their prompts' tokens and
    their decoded ones. A prompt's batch adds its union to the table, each expert once, so
    its counts alone make a 67-token prompt about six tokens."""
    if not g.moe_layers or not g.k:
        return 0.0
    L = len(g.moe_layers)
    counted = sum(usage.values()) / g.k / L
    c = counters or {}
    return max(counted, (c.get("prompt_tokens", 0) + c.get("routes", 0) / g.k) / L)


@dataclasses.dataclass(frozen=True)
class Dynamics:
    """A store's learned decode dynamics (``learned_dynamics``)."""

    stickiness: float
    reuse: float
    tokens: float                       # decoded tokens they were learned from, per MoE layer

    def describe(self) -> str:
        return (f"its runs' decode beyond chance: {self.stickiness:.0%} of experts kept token to "
                f"token, {self.reuse:.0%} of the rest reused, over {self.tokens:.0f} tokens")


def learned_dynamics(g: Geometry, counters: dict[str, int],
                     usage: dict[tuple[int, int], float] | None = None) -> Dynamics | None:
    """How the store's earlier runs decoded (``runtime.cache.usage``'s counters), as the
    synthetic generator's decode parameters beyond what chance gives it; None below
    ``MIN_DYNAMICS_TOKENS`` decoded tokens, or where the runs did not count the chance
    baseline (``seen``: counters of older runs).

    The generator keeps a previous expert with probability ``stickiness``, else draws the pick
    from the run's earlier experts with probability ``reuse``, else a fresh one by popularity
    (``usage``, the learned counts ``usage_replay`` draws from; uniform without it), and a
    fresh pick lands on one of the previous token's k experts, or on one the run saw before,
    by chance as well. So each measured share is the chance's part plus the rest: the rest's
    reuse against the popularity the experts the runs had seen carry (``_seen_popularity``;
    after a prompt of a hundred tokens, most of it: counted as reuse, a random router would
    read as one that keeps to a working set, and the replay's tier would hit far more often
    than the runs' did); kept against independent picks' chance, ``k / n_experts`` (not the
    learned popularity's, which the runs' own stickiness concentrates on the experts they
    kept: that would count the stickiness as chance)."""
    routes, follows = counters.get("routes", 0), counters.get("follows", 0)
    tokens = routes / g.k / len(g.moe_layers) if g.k and g.moe_layers else 0.0
    seen_routes = counters.get("seen_routes", 0)
    if tokens < MIN_DYNAMICS_TOKENS or not seen_routes or not g.n_experts:
        return None
    kept = counters.get("kept", 0) / follows if follows else 0.0
    u = counters.get("reused", 0) / routes
    rest = (u - kept) / (1.0 - kept) if kept < 1.0 else 1.0     # the share of the rest reused
    c = g.k / g.n_experts
    m = _seen_popularity(g, usage or {}, counters.get("seen", 0) / seen_routes)
    return Dynamics(_beyond(kept, c, follows), _beyond(rest, (m - c) / (1.0 - c),
                                                       routes * (1.0 - kept)), tokens)


@dataclasses.dataclass(frozen=True)
class Coverage:
    """How much of a layer a store's earlier prompts touched (``learned_coverage``): as many
    distinct experts as prompts of their length would touch routing top-``k`` uniformly among
    ``effective`` equally likely experts."""

    effective: float
    k: int
    tokens: float                       # the prompts' mean length

    def touched(self, tokens: int) -> float:
        """Distinct experts of a layer a prompt of ``tokens`` tokens touches."""
        return distinct_experts(self.effective, self.k, tokens)

    def describe(self, n_experts: int) -> str:
        return (f"its runs' prompts touched {self.touched(round(self.tokens)):.0f} of {n_experts} "
                f"experts a layer in {self.tokens:.0f} tokens, as {self.effective:.0f} equally "
                "likely would")


def learned_coverage(g: Geometry, counters: dict[str, int]) -> Coverage | None:
    """The store's prompts' coverage (``runtime.cache.usage``'s prompt counters) as the
    effective expert count ``n`` whose uniform routing (``coldstart.distinct_experts``) touches
    the distinct experts they did at their mean length ``P`` (found by bisection in [k,
    n_experts]: fewer where the router is skewed or the prompts repeat words); None before a
    whole prompt of at least two tokens was counted at every MoE layer."""
    layers = counters.get("prompt_layers", 0)
    k, E = g.k, g.n_experts
    if layers < max(1, len(g.moe_layers)) or not k or E <= k:
        return None
    P = counters.get("prompt_tokens", 0) / layers
    D = counters.get("prompt_experts", 0) / layers
    if P < 2:
        return None
    lo, hi = float(k), float(E)
    if distinct_experts(hi, k, round(P)) > D:
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if distinct_experts(mid, k, round(P)) < D else (lo, mid)
    return Coverage(hi, k, P)


def _seen_popularity(g: Geometry, usage: dict[tuple[int, int], float], seen: float) -> float:
    """The popularity the experts a run has seen carry, when it has seen ``seen`` experts of a
    layer on average: the picks ``n`` that leave that many seen, ``sum(1 - (1 - p) ** n)``,
    found by bisection, then ``sum(p (1 - (1 - p) ** n))`` (``seen / n_experts`` when uniform)."""
    pop = _popularity(g, usage)
    p = pop / pop.sum(axis=1, keepdims=True)

    def seen_after(n: float):                  # [layers, experts]: P(seen after n picks)
        return 1.0 - (1.0 - p) ** n
    target = min(float(seen), g.n_experts * (1.0 - 1e-9))
    lo, hi = 0.0, 1.0
    while seen_after(hi).sum(axis=1).mean() < target and hi < 1e12:
        hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if seen_after(mid).sum(axis=1).mean() < target else (lo, mid)
    return min(1.0, float((p * seen_after(hi)).sum(axis=1).mean()))


def _popularity(g: Geometry, usage: dict[tuple[int, int], float], new: bool = False):
    """``[MoE layers, experts]``: the learned counts ((block, expert) → routes), and for the
    experts a layer's runs never chose the routes Good–Turing gives them: the unseen share of a
    layer's routes is about the share of its experts chosen exactly once (``N1 / N``), so they
    share ``N1`` routes (at least ``UNSEEN_ROUTES``) evenly. A flat prior of a route for every
    expert gave them a large share of a short history whose runs kept to a few experts a layer,
    and the replay read several times the bytes the runs did (bench/README.md, plan's learned
    routing); a varied history (many experts chosen once) still leaves them much. ``new``: a
    request unlike the learned ones instead, every expert a route more (``NEW_REQUEST``): a
    run on a prompt the store had not seen read several times the bytes of the next run on it,
    which the first had taught the store (bench/README.md)."""
    import numpy as np

    pop = np.zeros((len(g.moe_layers), g.n_experts))
    row = {layer: i for i, layer in enumerate(g.moe_layers)}
    for (layer, e), c in usage.items():
        if layer in row and 0 <= e < g.n_experts:
            pop[row[layer], e] += max(0.0, float(c))
    if new:
        return pop + UNSEEN_ROUTES
    for r in pop:
        unseen = r <= 0
        if unseen.any():
            once = int(np.count_nonzero((r > 0) & (r <= 1)))
            r[unseen] = max(float(once), UNSEEN_ROUTES) / int(unseen.sum())
    return pop


def _draw_weights(pop, k: int):
    """Gumbel-top-``k`` weights (``trace.synth``'s fresh picks: ``k`` experts a token without
    replacement) under which each expert's share of routes is its share of ``pop``
    (``[layers, experts]``): drawn in proportion to its counts, an expert in nearly every
    route would be left out of some and the rare ones drawn more often than they were. Its
    inclusion probability ``pi = k · share``; successive sampling includes an expert of
    weight ``w`` with probability about ``1 - exp(-w t)``, so ``w = -log(1 - pi)`` (``t`` = 1,
    where the ``pi`` sum to ``k``)."""
    import numpy as np

    pi = np.minimum(k * pop / pop.sum(axis=1, keepdims=True), 1.0 - 1e-6)
    return -np.log1p(-pi)


def _beyond(share: float, chance: float, n: float) -> float:
    """The probability ``p`` that makes ``share`` = p + (1 - p) ``chance``, counting only what
    exceeds chance by more than twice the binomial spread of ``n`` draws (where nearly every
    expert was seen, a share a little above chance would otherwise read as strong reuse)."""
    chance = min(1.0, max(0.0, chance))
    if chance >= 1.0 or n <= 0:
        return 0.0
    excess = share - chance - 2.0 * (chance * (1.0 - chance) / n) ** 0.5
    return min(1.0, max(0.0, excess / (1.0 - chance)))


def usage_replay(g: Geometry, usage: dict[tuple[int, int], float], spec: str, *,
                 tokens: int = DEFAULT_TOKENS, seed: int = 0,
                 dynamics: Dynamics | None = None) -> Replay:
    """A trace drawn from a store's learned usage ((block, expert) → routes) with the
    dynamics of the preset ``spec``: each layer's fresh picks are drawn so that an expert is
    in a token's route as often as the learned counts (``_popularity``) say
    (``_draw_weights``). With ``dynamics`` the tokens after the first quarter (what ``route``
    learns from, as a run's decode follows its prompt) keep and reuse experts as the store's
    runs did, and no pick follows the preset's cross-layer links: those are random
    permutations, not this model's, and they drew a capped Qwen3-30B-A3B cut's decode away
    from the experts its runs use (bench/README.md, plan's learned routing)."""
    new = spec.endswith(NEW_REQUEST)
    spec = spec[:-len(NEW_REQUEST)] if new else spec
    pop = _draw_weights(_popularity(g, usage, new), g.k)
    s = parse_spec(spec, n_layers=len(g.moe_layers), n_experts=g.n_experts, k=g.k,
                   n_tokens=tokens, expert_bytes=g.slot_bytes, seed=seed)
    if dynamics is not None:
        s = dataclasses.replace(s, decode_after=max(1, tokens // 4), cross_layer=0.0,
                                decode_stickiness=dynamics.stickiness, reuse=dynamics.reuse)
    header = dataclasses.replace(synthetic_header(s), expert_bytes=g.extent_bytes)
    return Replay.from_chunks(header, synthetic_chunks(s, popularity=pop))


def trace_replay(g: Geometry, path: str) -> Replay:
    """A recorded trace mapped onto the model: its layers are either the MoE layers in order or
    block indices; rows of other blocks (NextN) are dropped; bytes are the model's extents."""
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such trace file", fix="pass a routing trace (.eftrace)")
    rp = Replay.from_file(path)
    h = rp.header
    moe = list(g.moe_layers)
    if h.n_experts != g.n_experts or h.k != g.k:
        raise UsageError(f"{path}: the trace has {h.n_experts} experts, top-{h.k}; the model "
                         f"{g.n_experts} experts, top-{g.k}",
                         fix="pass a trace recorded with this model")
    if h.n_layers == len(moe):
        sizes = g.extent_bytes
        keep = None
    elif h.n_layers > max(moe):
        ext = dict(zip(moe, g.extent_bytes))
        sizes = tuple(ext.get(i, 0) for i in range(h.n_layers))
        keep = set(moe)
    else:
        raise UsageError(f"{path}: the trace has {h.n_layers} layers; the model {len(moe)} MoE "
                         f"layers in {g.n_layers} blocks",
                         fix="pass a trace recorded with this model")
    header = TraceHeader(h.n_layers, h.n_experts, h.k, sizes, h.n_draft, dict(h.meta))
    if keep is None:
        return Replay(header, rp.rows, rp.clock, rp.n_tokens)
    E = h.n_experts
    rows, clock = [], []
    for row, t in zip(rp.rows, rp.clock):
        if row and row[0] // E in keep:
            rows.append(row)
            clock.append(t)
    if not rows:
        raise UsageError(f"{path}: no rows in the model's MoE layers", fix="pass a trace of this model")
    return Replay(header, rows, clock, len(set(clock)))


def _all_bytes(rp: Replay) -> int:
    return sum(rp.key_bytes(key) for row in rp.rows for key in row)


def route(g: Geometry, replay: Replay, vram_slots: int, ram_slots: int, *, experts_on_gpu: bool,
          label: str, synthetic: bool, policy: str = DEFAULT_POLICY) -> Routing:
    """Replay at (VRAM, RAM) slots from a warm start; bytes per token moved between tiers."""
    if replay.n_tokens < 2 or not replay.rows:
        raise UsageError(f"routing {label}: fewer than 2 tokens", fix="use a longer trace (--tokens)")
    learn_tokens = max(1, replay.n_tokens // 4)
    learn, rest = replay.split(learn_tokens)
    if not rest.rows:
        rest = replay
    warm = usage_rates(usage_counts(learn), replay.header.k)
    # a long-used store's usage table knows every expert: the ones the learning tokens did not
    # touch rank last, so a tier that can hold them starts with them (no compulsory misses)
    for layer, size in enumerate(replay.header.expert_bytes):
        if size:
            for e in range(replay.header.n_experts):
                warm.setdefault((layer, e), 1e-9)
    tokens = rest.n_tokens
    accesses = sum(len(r) for r in rest.rows)
    total = _all_bytes(rest)
    width = max(len(r) for r in rest.rows)
    if vram_slots and vram_slots < width:
        vram_slots = 0
    if ram_slots and ram_slots < width:
        ram_slots = 0
    if not vram_slots and not ram_slots:
        per = total / tokens
        return Routing(label, synthetic, policy, tokens, 0.0, 0.0, 1.0, per,
                       per if experts_on_gpu else 0.0, 0.0)
    factory = make_factory(policy, n_layers=replay.header.n_layers, route_width=width,
                           layer_of=rest.layer_of)
    try:
        r = simulate(rest, factory, vram=vram_slots, ram=ram_slots, warm=warm)
    except CapacityError as e:
        raise UsageError(f"policy {policy!r} cannot run at {vram_slots} VRAM / {ram_slots} RAM "
                         f"slots: {e.problem}", fix="use a global-pool policy (e.g. wlfu)") from None
    h2d = r.bytes_h2d
    if experts_on_gpu and not vram_slots:          # every expert goes up to the GPU to be used
        h2d = total
    per = 1.0 / tokens
    return Routing(label, synthetic, policy, tokens, r.vram_hits / accesses, r.ram_hits / accesses,
                   r.misses / accesses, r.bytes_nvme * per, h2d * per, r.bytes_d2h * per)


def ideal_routing(policy: str = "") -> RoutingRange:
    """Every expert already in VRAM: no NVMe or PCIe bytes (an upper bound on tokens/s)."""
    r = Routing("every expert cached", False, policy, 1, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return RoutingRange(r, r)
