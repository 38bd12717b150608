"""``expertfs verify STORE [--source MODEL.gguf]``"""

from __future__ import annotations

import argparse
import sys

from ..units import fmt_bytes
from ..store.verify import verify
from ._common import print_json, progress_bar


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a store: structure, checksums, optionally the source",
                       description="Check a store's structure and every checksum; with --source, "
                       "also that every byte equals the GGUF it came from. Exit 0 when sound, 1 "
                       "with the list of bad extents.")
    p.add_argument("store")
    p.add_argument("--source", nargs="+", metavar="MODEL.gguf", help="the GGUF (all shards or the first)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with progress_bar("verify", not args.json) as bar:
        rep = verify(args.store, args.source, progress=bar)
    if args.json:
        print_json(rep.as_dict())
    elif rep.ok:
        src = " and equal to the source" if rep.source_checked else ""
        print(f"{rep.store}: OK, {rep.extents} extents, {fmt_bytes(rep.bytes_checked)} checked{src}")
    else:
        print(f"{rep.store}: {len(rep.problems)} problem(s)", file=sys.stderr)
        for p in rep.problems:
            print(f"  {p}", file=sys.stderr)
    return 0 if rep.ok else 1
