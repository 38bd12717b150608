"""``expertfs bench io STORE|FILE``: storage bandwidth at the engine's access pattern."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import UsageError
from ..units import parse_size
from ._bench import get_bench_subparsers

__all__ = ["register", "run"]

_EPILOG = """\
Random whole-expert reads (the engine's access pattern) per backend and queue depth, cold,
against a large sequential read of the same file in the same run. Runs vary: compare the
ratios of one run, not absolute numbers across runs. Dropping the page cache needs root;
otherwise the file's own pages are dropped (O_DIRECT reads are cold either way).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    sub = get_bench_subparsers(subparsers)
    p = sub.add_parser("io", help="storage bandwidth per I/O backend and queue depth",
                       description="Benchmark expert reads from a store (or any file).",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="STORE|FILE", help="a store folder or a plain file")
    p.add_argument("--backend", default="all",
                   help="all, or backends separated by commas: kvikio, direct, buffered, mmap "
                        "(default: all)")
    p.add_argument("--qd", default="1,4,16,32", help="queue depths, comma separated (default: 1,4,16,32)")
    p.add_argument("--size", default="expert",
                   help="'expert' (whole extents; a store only) or a read size such as 4MiB "
                        "(default: expert for a store, 4MiB for a file)")
    p.add_argument("--total", default="256M", help="bytes read per point (default: 256M)")
    p.add_argument("--seq", default="512M", help="bytes of the sequential ceiling read (default: 512M)")
    p.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                   help="drop the page cache before each point (default: on)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check the bytes read after each point (default: on)")
    p.add_argument("--no-auto", dest="auto", action="store_false",
                   help="skip reporting what backend=auto would pick")
    p.add_argument("--seed", type=int, default=0, help="seed of the random read sample")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write GB/s against queue depth (matplotlib)")
    p.set_defaults(func=run)


def _size(text: str, flag: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}", fix=f"write {flag} as e.g. 4M or 1G") from None


def run(args: argparse.Namespace) -> int:
    from ..runtime.io.backends import BACKENDS
    from ..runtime.io.bench import format_point, format_report, run_bench, target_from_file, target_from_store
    from ..store.reader import Store, is_store

    backends = list(BACKENDS) if args.backend == "all" else [b.strip() for b in args.backend.split(",") if b.strip()]
    try:
        qds = [int(q) for q in args.qd.split(",") if q.strip()]
    except ValueError:
        raise UsageError(f"--qd {args.qd!r} is not a list of integers", fix="e.g. --qd 1,4,16,32") from None
    total, seq = _size(args.total, "--total"), _size(args.seq, "--seq")
    store = Store.open(args.target) if is_store(args.target) else None
    try:
        if args.size == "expert":
            if store is None:
                target = target_from_file(args.target, 4 << 20)
            else:
                target = target_from_store(store)
        else:
            size = _size(args.size, "--size")
            target = (target_from_store(store, read_size=size) if store is not None
                      else target_from_file(args.target, size))

        def progress(p) -> None:
            if not args.json and sys.stderr.isatty():
                print("\n".join(format_point(p)), file=sys.stderr, flush=True)

        report = run_bench(target, backends=backends, qds=qds, total_bytes=total, cold=args.cold,
                           seq_bytes=seq, verify=args.verify, seed=args.seed, with_auto=args.auto,
                           on_point=progress)
    finally:
        if store is not None:
            store.close()
    if args.plot:
        from ..runtime.io.bench_plot import plot_report
        plot_report(report, args.plot)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_report(report))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
