"""``expertfs plan``'s prediction: rates, per-token terms, advice, the choice of placement.

Pure arithmetic on ``plan.budget``'s budget (``plan.assumptions`` states the model): ``predict``
turns a ``Memory`` (one placement's budget), a ``RoutingRange`` (hit rates at its tiers) and
``Rates`` (storage, PCIe, per-device dequant+matmul, memory bandwidth, dispatch) into named
terms in seconds per token at a slow and a fast end; ``make_plan`` chooses among the options
and writes the advice; ``plan_to_dict`` is the ``--json`` schema (``SCHEMA``). The rates
themselves (stated defaults, a ``bench io`` profile) are ``plan.rates``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ...errors import UsageError
from .assumptions import (ASSUMPTIONS, ATTENTION_FAST_FRACTION, COMBINE, EXPERT_OVERHEAD_S, OPS_PER_LAYER,
                          PAGEABLE_FACTOR, SCHEMA, GiB, MiB)
from .budget import Box, Memory, Note, _gib
from .rereads import trunk_reads
from .coldstart import drive_share, start_terms, window_spare
from .geometry import Geometry, kv_cache_bytes
from .native import compute_cost as _compute_cost, layer_cost as _layer_cost, layer_key
from .overhead import source_label
from .overlap import OVERLAP_DETAIL, misses_cpu, token_overlap
from .rates import (PCIE_GENS, DeviceRates, LinearCost, Range, Rates, stated_cpu, stated_gpu,
                    stated_pcie, stated_storage, storage_from_profile)

__all__ = ["Range", "LinearCost", "DeviceRates", "Rates", "Routing", "RoutingRange", "Term",
           "Prediction", "Option", "Plan", "PCIE_GENS", "predict", "predict_option",
           "choose", "advise", "make_plan", "plan_to_dict", "stated_storage", "stated_pcie",
           "stated_cpu", "stated_gpu", "storage_from_profile"]


# routing (from the simulator) and the prediction
@dataclass(frozen=True)
class Routing:
    """Cache behaviour at the planned tiers, per token, from replaying a trace."""

    label: str
    synthetic: bool
    policy: str
    tokens: int
    vram_hit_rate: float
    ram_hit_rate: float
    miss_rate: float
    nvme_bytes_per_token: float
    h2d_bytes_per_token: float
    d2h_bytes_per_token: float
    prompt_cover: float = 0.0          # share of the experts the replay's first prompt tokens touch

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RoutingRange:
    slow: Routing
    fast: Routing

    def at(self, end: str) -> Routing:
        return self.slow if end == "slow" else self.fast


@dataclass(frozen=True)
class Term:
    name: str
    slow_s: float
    fast_s: float
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    terms: tuple[Term, ...]
    slow_s: float                      # seconds per token at the slow end (all terms summed)
    fast_s: float                      # at the fast end (overlapped); the band is the range
    dominant_slow: str                 # of the two: a faster drive's warm start reads more in
    dominant_fast: str                 # a short run, so its CPU can make the fast end slower

    @property
    def tok_s_low(self) -> float:
        return 1.0 / s if (s := max(self.slow_s, self.fast_s)) > 0 else math.inf

    @property
    def tok_s_high(self) -> float:
        return 1.0 / s if (s := min(self.slow_s, self.fast_s)) > 0 else math.inf

    def term(self, name: str) -> Term | None:
        return next((t for t in self.terms if t.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        total_slow = self.slow_s or 1.0
        return {"tok_s_low": self.tok_s_low, "tok_s_high": self.tok_s_high,
                "s_per_token_slow": self.slow_s, "s_per_token_fast": self.fast_s,
                "dominant_slow": self.dominant_slow, "dominant_fast": self.dominant_fast,
                "terms": {t.name: {**t.as_dict(), "share_slow": t.slow_s / total_slow}
                          for t in self.terms}, "combine": COMBINE}


_IO_TERMS = {"storage": "storage", "first_reads": "storage", "trunk_reads": "storage", "pcie": "pcie"}


def predict(g: Geometry, mem: Memory, routing: RoutingRange, rates: Rates, box: Box) -> Prediction:
    """Seconds per token, term by term, at the slow and the fast end (see the module docstring)."""
    pl = mem.placement
    trunk_rates = rates.gpu if pl.trunk == "gpu" else rates.cpu
    exp_rates = rates.gpu if pl.experts == "gpu" else rates.cpu
    terms: list[Term] = []

    def both(fn) -> tuple[float, float]:
        return fn("slow"), fn("fast")

    s = both(lambda e: routing.at(e).nvme_bytes_per_token / (rates.storage.at(e) * 1e9))
    r = routing.slow
    terms.append(Term("storage", *s,
                      f"{r.nvme_bytes_per_token / MiB:.0f} MiB/token read (miss {r.miss_rate:.1%} of "
                      f"{g.token_expert_bytes / MiB:.0f} MiB) at {rates.storage.slow:.2f}-"
                      f"{rates.storage.fast:.2f} GB/s"))
    if mem.trunk_evicted:
        terms.append(Term("trunk_reads", *trunk_reads(mem, rates.storage, g)))
    if pl.experts == "gpu":
        f = 1.0 if mem.pinned else PAGEABLE_FACTOR
        p = both(lambda e: max(routing.at(e).h2d_bytes_per_token, routing.at(e).d2h_bytes_per_token)
                 / (rates.pcie.at(e) * f * 1e9))
        terms.append(Term("pcie", *p,
                          f"{r.h2d_bytes_per_token / MiB:.0f} MiB/token up, "
                          f"{r.d2h_bytes_per_token / MiB:.0f} MiB demoted (full duplex: the larger "
                          f"counts) at {rates.pcie.slow * f:.1f}-{rates.pcie.fast * f:.1f} GB/s"
                          + ("" if mem.pinned else " (pageable)")))
    ex = both(lambda e: sum(_layer_cost(exp_rates, parts, g.k, e) for parts in g.expert_parts))
    native = sum(1 for parts in g.expert_parts if layer_key(parts, g.k) in exp_rates.layers)
    how = (f"runtime.kernels.moe on {native} of {len(g.moe_layers)} layers" if native
           else "dequant+matmul")
    terms.append(Term("experts", *ex,
                      f"{g.k} x {len(g.moe_layers)} experts ({g.token_expert_bytes / MiB:.0f} MiB "
                      f"incl. padding), {how} on the {pl.experts.upper()}"))
    per_layer = exp_rates.layer_s is not None and pl.trunk == pl.experts == "cpu"
    if not per_layer:
        n_exp = g.k * len(g.moe_layers)
        terms.append(Term("expert_overhead", n_exp * EXPERT_OVERHEAD_S[0],
                          n_exp * EXPERT_OVERHEAD_S[1],
                          f"{n_exp} experts x {EXPERT_OVERHEAD_S[1] * 1e6:.0f}-"
                          f"{EXPERT_OVERHEAD_S[0] * 1e6:.0f} us of runtime work each (stated)"))
    mats = g.trunk_compute(pl.trunk_mode, pl.trunk)
    tr = both(lambda e: _compute_cost(trunk_rates, mats, e, quantized=pl.trunk_mode == "quant"))
    terms.append(Term("trunk", *tr, f"{sum(m.nbytes * m.count for m in mats) / MiB:.0f} MiB of "
                                    f"trunk matrices ({pl.trunk_mode}) on the {pl.trunk.upper()}"))
    # the cache read (its fixed state part too), and the recurrent layers' state written back
    kv_slow, kv_fast = (kv_cache_bytes(g, ctx, mem.kv_type) + g.state_bytes
                        for ctx in (box.ctx, max(1, int(box.ctx * ATTENTION_FAST_FRACTION))))
    at = (kv_slow / (trunk_rates.mem_gbps.slow * 1e9), kv_fast / (trunk_rates.mem_gbps.fast * 1e9))
    what = "KV cache read" + (", KDA state read and written," if g.state_bytes else "")
    terms.append(Term("attention", *at, f"{what} {kv_slow / MiB:.0f} MiB at ctx {box.ctx} "
                                        f"({kv_fast / MiB:.0f} MiB at the fast end) at "
                                        f"{trunk_rates.mem_gbps.slow:.0f}-"
                                        f"{trunk_rates.mem_gbps.fast:.0f} GB/s"))
    syncs = (1 if pl.experts == "gpu" else 0) + (2 if pl.experts != pl.trunk else 0)
    if per_layer:
        lr, tk = exp_rates.layer_s, exp_rates.token_s or Range(0.0, 0.0)
        dp = both(lambda e: g.n_layers * lr.at(e) + tk.at(e))
        terms.append(Term("dispatch", *dp, f"{g.n_layers} layers x {lr.fast * 1e6:.0f}-"
                                           f"{lr.slow * 1e6:.0f} us + {tk.fast * 1e6:.0f}-"
                                           f"{tk.slow * 1e6:.0f} us a token of the runtime's "
                                           f"own work ({source_label(lr.source)})"))
    else:
        dp = both(lambda e: g.n_layers * (OPS_PER_LAYER * trunk_rates.op_s.at(e)
                                         + syncs * rates.gpu.sync_s.at(e)))
        terms.append(Term("dispatch", *dp, f"{g.n_layers} layers x ({OPS_PER_LAYER} small ops"
                                           + (f" + {syncs} device syncs" if syncs else "") + ")"))
    terms.append(Term("read_cpu", *misses_cpu(routing, rates)))
    compute = both(lambda e: sum(t.slow_s if e == "slow" else t.fast_s for t in terms
                                 if t.name not in _IO_TERMS))
    ahead, *ov = token_overlap(g, mem, exp_rates, routing, s, per_layer)
    terms += [Term("overlap", -ov[0], -ov[1], OVERLAP_DETAIL[ahead])] if ov[0] > 0 else []
    drive = drive_share(g, mem, box.page_cache)
    terms += [Term(*t) for t in start_terms(
        g, hits=both(lambda e: 1 - routing.at(e).miss_rate), ram_tier_bytes=mem.ram.tier_bytes,
        tier_bytes=mem.ram.tier_bytes + (mem.vram.tier_bytes if mem.vram else 0),
        prompt_tokens=box.prompt_tokens, n_predict=box.n_predict, storage=rates.storage,
        prompt_cover=min(routing.slow.prompt_cover, routing.fast.prompt_cover), compute_s=compute,
        read_cpu=rates.read_cpu, verify=rates.verify, drive=drive,
        window=window_spare(g, mem, drive) > 0)]
    slow = sum(t.slow_s for t in terms)
    compute_fast = sum(t.fast_s for t in terms if t.name not in _IO_TERMS and t.name != "overlap")
    io = {c: sum(t.fast_s for t in terms if _IO_TERMS.get(t.name) == c) for c in ("storage", "pcie")}
    fast = (max(compute_fast, *io.values()) if ahead
            else max(compute_fast + io["storage"] - ov[1], io["pcie"]))
    dom_slow, io_fast = max(terms, key=lambda t: t.slow_s).name, max(io, key=lambda c: io[c])
    dom_fast = io_fast if io[io_fast] >= compute_fast else "compute"
    return Prediction(tuple(terms), slow, fast, dom_slow, dom_fast)


# advice, the choice between placements, and the whole plan
def advise(g: Geometry, mem: Memory, pred: Prediction | None, routing: RoutingRange | None,
           rates: Rates | None, box: Box) -> list[Note]:
    """Plain words about what limits decode and what to change."""
    out: list[Note] = []
    if pred is None:
        return out
    t = pred.term(dom := pred.dominant_slow)
    share = t.slow_s / pred.slow_s if t and pred.slow_s else 0.0
    tiers = mem.ram.tier_bytes + (mem.vram.tier_bytes if mem.vram else 0)
    where = {"experts": mem.placement.experts, "trunk": mem.placement.trunk,
             "dispatch": mem.placement.trunk, "attention": mem.placement.trunk}.get(dom, "")
    if dom == "storage":
        more = ""
        if tiers < g.decode_expert_bytes:
            more = (f"; the tiers hold {tiers / max(1, g.decode_expert_bytes):.0%} of the experts "
                    f"({_gib(tiers)} of {_gib(g.decode_expert_bytes)}): more RAM or VRAM raises the "
                    "hit rate")
        out.append(Note("info", "storage_bound",
                        f"decode is storage-bound ({share:.0%} of the slow-end time): a faster "
                        f"drive or backend lifts it in proportion{more}"))
    elif dom in ("first_reads", "warm_start"):
        what = ("the first reads into the empty tiers" if dom == "first_reads" else
                "the warm start's background reads into the RAM tier (their CPU)")
        out.append(Note("info", dom, f"{what} dominate a {box.n_predict}-token run ({share:.0%}): "
                        "longer runs amortise them, `expertfs run --preload` reads before decoding"))
    elif dom in ("experts", "trunk") and where == "cpu":
        gpu = ("a GPU that holds the trunk (see above)" if box.vram > 0 and dom == "trunk"
               else "a GPU (--vram)")
        out.append(Note("info", "cpu_bound",
                        f"decode is bound by the {dom.rstrip('s')} products on the CPU ({share:.0%} of the "
                        f"slow-end time): {gpu} computes it far faster; more cores help"))
    elif dom in ("experts", "trunk", "dispatch"):
        out.append(Note("info", "compute_bound",
                        f"decode is compute-bound ({dom}, {share:.0%} of the slow-end time) on the "
                        f"{where.upper()}: a larger cache would not help much"))
    elif dom == "pcie":
        out.append(Note("info", "pcie_bound",
                        f"decode is bound by host->device copies ({share:.0%}): a larger VRAM tier"
                        + (", a pinned RAM tier (--pin-budget)" if not mem.pinned else "")
                        + " or a faster PCIe link helps"))
    elif dom == "attention":
        out.append(Note("info", "attention_bound",
                        f"reading the KV cache dominates ({share:.0%}) at --ctx {box.ctx}: a "
                        "shorter context or a quantized KV cache (--kv-type q8_0) helps"))
    if routing is not None and routing.slow.synthetic:
        out.append(Note("info", "routing_synthetic",
                        "hit rates come from synthetic routing ("
                        + (routing.slow.label if routing.slow.label == routing.fast.label else
                           f"slow end {routing.slow.label}, fast end {routing.fast.label}")
                        + "), not from this model: record a trace of a real run "
                          "(expertfs run STORE --trace T) and pass --trace"))
    if rates is not None and rates.storage.source.startswith("stated"):
        out.append(Note("info", "storage_default",
                        "storage was not measured (stated default used): run `expertfs bench io "
                        "STORE --json > io.json` on the drive that holds the store and pass "
                        "--io-profile io.json"))
    return out


@dataclass(frozen=True)
class Option:
    """One budgeted placement with its prediction (None when it cannot run)."""

    memory: Memory
    routing: RoutingRange | None = None
    prediction: Prediction | None = None
    bound: float | None = None         # not simulated: tok/s it could not beat (every expert cached)

    @property
    def score(self) -> float:
        p = self.prediction
        return math.sqrt(p.tok_s_low * p.tok_s_high) if p else 0.0

    def as_dict(self) -> dict[str, Any]:
        m, p = self.memory, self.prediction
        return {"placement": m.placement.name, "supported": m.placement.supported,
                "runnable": m.runnable, "tok_s_low": p.tok_s_low if p else None,
                "tok_s_high": p.tok_s_high if p else None, "at_most_tok_s": self.bound,
                "vram_tier_experts": m.vram.tier_slots if m.vram else 0,
                "ram_tier_experts": m.ram.tier_slots,
                "why_not": [n.text for n in m.notes if n.level == "error"]}


def choose(options: Sequence[Option], forced: bool = False) -> Option:
    """The runnable option ``expertfs run`` supports with the best predicted tokens/s (geometric
    mean of the range); ``forced`` keeps the only option given. With nothing runnable, the one
    needing the least RAM (its error says what is missing)."""
    if not options:
        raise UsageError("no placement to plan", fix="check --placement and --trunk")
    if forced and len(options) == 1:
        return options[0]
    ok = [o for o in options if o.memory.runnable and o.prediction is not None]
    pool = [o for o in ok if o.memory.placement.supported] or ok
    if pool:
        return max(pool, key=lambda o: o.score)
    return min(options, key=lambda o: o.memory.ram.fixed)


@dataclass(frozen=True)
class Plan:
    geometry: Geometry
    box: Box
    memory: Memory
    rates: Rates | None
    routing: RoutingRange | None
    prediction: Prediction | None
    notes: tuple[Note, ...]
    alternatives: tuple[Option, ...] = ()
    probes: Mapping[str, Any] = field(default_factory=dict)     # raw measurements, for --json
    first_token: Any = None            # plan.prefill.FirstToken: the prompt's prefill (CPU runs)

    @property
    def exit_code(self) -> int:
        return 0 if self.memory.runnable else 1

    def run_args(self, store: str | None = None) -> str | None:
        """The ``expertfs run`` flags that execute this plan (the store's path when the plan was
        made from a store, else STORE)."""
        m = self.memory
        if store is None:
            src = self.geometry.source
            store = src.split(" ", 1)[1] if src.startswith("store ") else "STORE"
        if not m.runnable or not m.placement.supported:
            return None

        def size(n: int) -> str:             # rounded up: the runtime floors budgets to slots
            return (f"{math.ceil(n / GiB * 100) / 100:.2f}G" if n >= GiB
                    else f"{max(1, math.ceil(n / MiB))}M")

        args = [f"expertfs run {store}", f"--device {'cuda' if m.placement.gpu else 'cpu'}",
                f"--ram {size(m.host_slab)}"]
        if m.vram is not None:
            args.append(f"--vram {size(m.vram.tier_bytes)}")
        args += [f"--trunk {m.placement.trunk_mode}", f"--ctx {self.box.ctx}"]
        args += [f"-n {self.box.n_predict}"] if self.box.n_predict != 64 else []
        args += [f"--act-quant {self.box.act_quant}"] if self.box.act_quant != "off" else []
        return " ".join(args)


def predict_option(g: Geometry, box: Box, mem: Memory, rates: Rates | None,
                   routing: RoutingRange | None) -> Option:
    pred = predict(g, mem, routing, rates, box) if (mem.runnable and rates and routing) else None
    return Option(mem, routing, pred)


def make_plan(g: Geometry, box: Box, options: Sequence[Option], rates: Rates | None,
              probes: Mapping[str, Any] | None = None, forced: bool = False) -> Plan:
    """The chosen option as a plan, with notes on the others (why a preferred placement did not
    fit; a faster one the runtime cannot run yet)."""
    best = choose(options, forced)
    mem = best.memory
    notes = list(mem.notes)
    if mem.runnable:
        # why the GPU placement (or float trunk) was not taken, when it was not
        for w in ("gpu", "hybrid"):
            tried = [o for o in options if o.memory.placement.where == w]
            if tried and not any(o.memory.runnable for o in tried) and mem.placement.where != w:
                err = next((n for o in reversed(tried) for n in o.memory.notes if n.level == "error"),
                           None)
                if err is not None and not any(n.code == err.code for n in notes):
                    notes.append(Note("warning", err.code, err.text))
        faster = [o for o in options if o is not best and o.prediction is not None
                  and o.score > best.score * 1.1]
        for o in sorted(faster, key=lambda o: -o.score)[:1]:
            p = o.prediction
            why = ("not in expertfs run yet: it runs trunk and experts on one device"
                   if not o.memory.placement.supported else "")
            notes.append(Note("info", "alternative",
                              f"{o.memory.placement.name} would predict {p.tok_s_low:.2f}-"
                              f"{p.tok_s_high:.2f} tokens/s" + (f" ({why})" if why else "")))
    notes += advise(g, mem, best.prediction, best.routing, rates, box)
    cpu = (probes or {}).get("cpu") or {}
    if cpu.get("busy") and "cpu" in (mem.placement.trunk, mem.placement.experts):
        notes.append(Note("info", "busy_machine",
                          f"this machine was busy while measuring (load {cpu.get('load_average', 0):.1f} "
                          f"on {cpu.get('cpus')} CPUs): CPU figures are single-threaded, so the "
                          "CPU terms are pessimistic"))
    return Plan(g, box, mem, rates, best.routing, best.prediction, tuple(notes),
                tuple(o for o in options if o is not best), dict(probes or {}))


def plan_to_dict(p: Plan) -> dict[str, Any]:
    m = p.memory
    return {
        "schema": SCHEMA, "status": "fits" if m.runnable else "cannot_run",
        "exit_code": p.exit_code,
        "model": p.geometry.as_dict(),
        "box": {"ram_bytes": p.box.ram, "vram_bytes": p.box.vram, "ctx": p.box.ctx,
                "kv_type": p.box.kv_type, "label": p.box.label, "pin_budget": p.box.pin_limit},
        "placement": m.placement.as_dict(),
        "budget": m.as_dict(p.geometry),
        "rates": p.rates.as_dict() if p.rates else None,
        "routing": ({"slow": p.routing.slow.as_dict(), "fast": p.routing.fast.as_dict()}
                    if p.routing else None),
        "prediction": p.prediction.as_dict() if p.prediction else None,
        "first_token": p.first_token.as_dict() if p.first_token else None,
        "run": p.run_args(),
        "alternatives": [o.as_dict() for o in p.alternatives],
        "notes": [n.as_dict() for n in p.notes], "assumptions": dict(ASSUMPTIONS),
        "measurements": dict(p.probes),
    }
