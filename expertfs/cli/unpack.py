"""``expertfs unpack STORE -o OUT.gguf``"""

from __future__ import annotations

import argparse

from ..units import fmt_bytes
from ..store.unpack import unpack
from ._common import print_json, progress_bar


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("unpack", help="a store back to a GGUF, bit-exact",
                       description="Rebuild a GGUF from a store: the source's metadata and tensor "
                       "bytes, in its order, with llama.cpp's offset rules.")
    p.add_argument("store")
    p.add_argument("-o", "--output", required=True, help="the .gguf to write")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with progress_bar("unpack", not args.json) as bar:
        res = unpack(args.store, args.output, force=args.force, progress=bar)
    if args.json:
        print_json(res)
    else:
        print(f"{res['gguf']}: {res['tensors']} tensors, {fmt_bytes(res['bytes'])}")
    return 0
