"""``expertfs bench cache --trace T``: cache policies replayed on a routing trace, beside Belady."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import UsageError
from ..units import parse_size

__all__ = ["register", "run"]

_EPILOG = """\
Each policy is replayed on the trace at each capacity point (VRAM slots x RAM slots; a slot
holds the model's largest expert) and compared with the Belady bound, the most hits any cache
of that size could get. "hit" counts accesses not read from NVMe; tiers are exclusive unless
--inclusive. Policies: lru, lfu, lfud[@HALF_LIFE], arc, wlfu[@HALF_LIFE], each optionally
/layer (even per-layer quotas instead of one pool); 'all' runs a standard set.

  expertfs bench cache --synthetic hot,n_tokens=4096 --capacity 12.5%,25%,50% --plot hits.png
  expertfs bench cache --trace run.eftrace --ram 4G,8G,16G --vram 0,8G --json
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    sub = _bench_subparsers(subparsers)
    p = sub.add_parser("cache", help="cache policies on a routing trace, beside the Belady bound",
                       description="Replay a routing trace against the expert cache policies.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="T", help="a routing trace file (expertfs trace format)")
    src.add_argument("--synthetic", metavar="SPEC",
                     help="generate a trace: a preset (uniform, diffuse, sticky, hot, drift) and/or "
                          "field=value, e.g. 'hot,n_tokens=4096,n_layers=32,n_experts=128,k=8'")
    p.add_argument("--save-trace", metavar="OUT", help="with --synthetic: also write the trace")
    p.add_argument("--policies", default="all", help="'all' or names separated by commas")
    p.add_argument("--ram", help="RAM tier sizes, comma separated (e.g. 4G,8G)")
    p.add_argument("--vram", help="VRAM tier sizes, comma separated (default: none)")
    p.add_argument("--capacity", help="RAM tier in experts (slots), or N%% of all experts, comma "
                                      "separated (default: 12.5%%,25%%,50%% when --ram is not given)")
    p.add_argument("--vram-capacity", help="VRAM tier in experts or N%% (like --capacity)")
    p.add_argument("--inclusive", action="store_true",
                   help="RAM keeps a copy of what is in VRAM (default: exclusive tiers)")
    p.add_argument("--drafts", action="store_true", help="replay draft routes too (the verify batch)")
    p.add_argument("--warm-from", metavar="T2", help="seed the caches from the usage in another trace")
    p.add_argument("--warm-tokens", type=int, metavar="N",
                   help="learn usage from the first N tokens, replay the rest from a warm cache")
    p.add_argument("--allow-partial", action="store_true",
                   help="use the complete chunks of a trace whose writer did not finish")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write hit rate against capacity (matplotlib)")
    p.set_defaults(func=run)


def _bench_subparsers(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The ``bench`` sub-parsers: the shared helper's, or a ``bench`` parser of our own."""
    try:
        from ._bench import get_bench_subparsers
    except ImportError:
        parser = subparsers.choices.get("bench") or subparsers.add_parser("bench", help="benchmarks")
        found = getattr(parser, "_expertfs_bench_subparsers", None)
        if found is None:
            found = parser.add_subparsers(dest="bench_command", metavar="BENCH")
            parser._expertfs_bench_subparsers = found  # type: ignore[attr-defined]
        return found
    return get_bench_subparsers(subparsers)


def _slots(text: str | None, flag: str, total_experts: int) -> list[int]:
    if not text:
        return []
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            out.append(round(float(item[:-1]) / 100 * total_experts) if item.endswith("%")
                       else int(item))
        except ValueError:
            raise UsageError(f"{flag}: {item!r} is not a count or a percentage",
                             fix=f"e.g. {flag} 256,512 or {flag} 25%") from None
    return out


def _bytes(text: str | None, flag: str, slot: int) -> list[int]:
    if not text:
        return []
    try:
        return [parse_size(t) // slot for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise UsageError(f"{flag}: {e}", fix=f"e.g. {flag} 4G,8G") from None


def _load(args: argparse.Namespace):
    from ..runtime.sim.replay import Replay
    from ..runtime.trace.synth import parse_spec, synthetic_chunks, synthetic_header, write_synthetic

    if args.trace:
        if args.save_trace:
            raise UsageError("--save-trace goes with --synthetic", fix="drop --save-trace")
        return Replay.from_file(args.trace, include_drafts=args.drafts,
                                allow_partial=args.allow_partial)
    spec = parse_spec(args.synthetic)
    if args.save_trace:
        write_synthetic(args.save_trace, spec)
        return Replay.from_file(args.save_trace, include_drafts=args.drafts)
    return Replay.from_chunks(synthetic_header(spec), synthetic_chunks(spec),
                              include_drafts=args.drafts)


def run(args: argparse.Namespace) -> int:
    from ..runtime.policies.base import usage_rates
    from ..runtime.policies.registry import parse_policies
    from ..runtime.sim.replay import Replay, usage_counts
    from ..runtime.sim.sweep import Point, format_sweep, plot_sweep, run_sweep

    policies = parse_policies(args.policies)
    replay = _load(args)
    h = replay.header
    # N% counts the routed experts only: dense and NextN-less layers have expert_bytes 0
    slot = max(h.expert_bytes)
    total = sum(1 for b in h.expert_bytes if b > 0) * h.n_experts
    rams = _bytes(args.ram, "--ram", slot) + _slots(args.capacity, "--capacity", total)
    vrams = _bytes(args.vram, "--vram", slot) + _slots(args.vram_capacity, "--vram-capacity", total)
    if not rams:
        rams = [0] if vrams else _slots("12.5%,25%,50%", "--capacity", total)
    points = [Point(v, r) for v in (vrams or [0]) for r in rams if v or r]
    if not points:
        raise UsageError("no cache tier in any capacity point", fix="give --ram or --vram sizes > 0")

    warm = None
    if args.warm_from and args.warm_tokens:
        raise UsageError("--warm-from and --warm-tokens both given", fix="choose one source of usage")
    if args.warm_tokens:
        learn, replay = replay.split(args.warm_tokens)
        if not replay.rows:
            raise UsageError(f"--warm-tokens {args.warm_tokens} leaves nothing to replay",
                             fix="learn from fewer tokens than the trace has")
        warm = usage_rates(usage_counts(learn), h.k)
    elif args.warm_from:
        other = Replay.from_file(args.warm_from, allow_partial=args.allow_partial)
        if (other.header.n_layers, other.header.n_experts) != (h.n_layers, h.n_experts):
            raise UsageError(f"--warm-from trace has {other.header.n_layers} layers x "
                             f"{other.header.n_experts} experts, the replayed one "
                             f"{h.n_layers} x {h.n_experts}", fix="learn from a run of the same model")
        warm = usage_rates(usage_counts(other), h.k)

    def progress(msg: str) -> None:
        if sys.stderr.isatty() and not args.json:
            print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)

    sweep = run_sweep(replay, policies, points, inclusive=args.inclusive, warm=warm,
                      progress=progress)
    if sys.stderr.isatty() and not args.json:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.plot:
        plot_sweep(sweep, args.plot)
    if args.json:
        print(json.dumps(sweep.as_dict(), indent=1))
    else:
        print(format_sweep(sweep))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
