"""The shared ``expertfs bench`` command: each benchmark module adds its own sub-command.

``bench_io.py`` adds ``bench io``, ``bench_cache.py`` adds ``bench cache``; whichever module
registers first creates ``bench``. Use::

    def register(subparsers):
        sub = get_bench_subparsers(subparsers)
        p = sub.add_parser("cache", help=..., description=...)
        p.set_defaults(func=run)
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["get_bench_subparsers"]

_ATTR = "_expertfs_bench_subparsers"


def get_bench_subparsers(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The sub-parsers of ``expertfs bench``, creating ``bench`` the first time."""
    parser = subparsers.choices.get("bench")
    if parser is None:
        parser = subparsers.add_parser(
            "bench", help="benchmarks: storage at the engine's access pattern (io), cache "
                          "policies on routing traces (cache)",
            description="Benchmarks. Each sub-command measures one part of the engine.")
        sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")

        def no_sub(args: argparse.Namespace) -> int:
            parser.print_help(sys.stderr)
            return 2

        parser.set_defaults(func=no_sub)
        setattr(parser, _ATTR, sub)
    return getattr(parser, _ATTR)
