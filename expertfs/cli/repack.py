"""``expertfs repack MODEL.gguf [more shards] -o STORE``"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from ..errors import UsageError
from ..units import fmt_bytes
from ..store.repack import repack
from ._common import print_json, progress_bar, size_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("repack", help="GGUF (single or split) -> per-expert store (lossless)",
                       description="Turn a GGUF (one file, or every shard of a split GGUF) into a "
                       "store: one page-aligned extent per expert and an LMDB index. Crash-safe: "
                       "the store appears only when complete; an interrupted repack resumes.")
    p.add_argument("model", nargs="+", help="the .gguf (for a split model: the first shard, or all)")
    p.add_argument("-o", "--output", required=True, help="the store folder to create")
    p.add_argument("--align", type=size_arg, default=4096,
                   help="extent alignment, a power of two from 4K to 2M (default 4K)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing store (only once the new one is complete)")
    p.add_argument("--restart", action="store_true",
                   help="ignore an interrupted repack's progress and start over")
    p.add_argument("--consume-source", action="store_true",
                   help="DESTRUCTIVE: build the store in place of the GGUF, releasing its bytes "
                   "(hole punching) as the store takes them over and deleting the GGUF once the "
                   "store is complete, so the disk needs room for about one copy window, not a "
                   "second model; crash-safe (run it again to resume) and unpack gives the GGUF "
                   "back bit for bit. Refused on file systems that cannot punch holes and on "
                   "symlinked or hard-linked sources")
    p.add_argument("--full-readback", action="store_true",
                   help="with --consume-source: read each window back whole and check it "
                   "against its checksums before releasing the source bytes it holds (slower: "
                   "the model is read twice), instead of checking that every block was written "
                   "and reading back spots of it")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.full_readback and not args.consume_source:
        raise UsageError("--full-readback only applies to --consume-source (a normal repack "
                         "releases nothing)", path=args.output,
                         fix="add --consume-source, or drop --full-readback")
    if args.consume_source:
        with _in_place_bar(not args.json) as (bar, freed):
            res = repack(args.model, args.output, alignment=args.align, force=args.force,
                         resume=not args.restart, progress=bar, consume_source=True,
                         on_freed=freed, full_readback=args.full_readback)
    else:
        with progress_bar("repack", not args.json) as bar:
            res = repack(args.model, args.output, alignment=args.align, force=args.force,
                         resume=not args.restart, progress=bar)
    d = res.as_dict()
    if args.json:
        print_json(d)
        return 0
    rate = d["bytes_per_second"] or 0
    resumed = f" (resumed after {fmt_bytes(res.resumed_from_bytes)})" if res.resumed_from_bytes else ""
    print(f"{res.store}: {d['moe_layers']} MoE layers x {d['expert_count']} experts, "
          f"{fmt_bytes(d['expert_bytes'])} experts + {fmt_bytes(d['trunk_bytes'])} trunk{resumed}")
    print(f"copied {fmt_bytes(res.bytes_copied)} in {res.seconds:.2f} s ({fmt_bytes(rate)}/s), "
          f"{'O_DIRECT' if res.direct_io else 'buffered'} writes")
    if args.consume_source:
        print(f"built in place: released {fmt_bytes(d['in_place']['released_bytes'])} of the "
              f"source as it went; deleted {', '.join(d['in_place']['sources'])}")
    return 0


@contextmanager
def _in_place_bar(enabled: bool) -> Iterator[tuple[Callable[[int, int], None], Callable[[int], None]]]:
    """The progress bar of an in-place repack: bytes stored, and the source's disk freed so far."""
    if not enabled or not sys.stderr.isatty():
        yield (lambda done, total: None), (lambda n: None)
        return
    from tqdm import tqdm
    bar = tqdm(desc="repack in place", unit="B", unit_scale=True, unit_divisor=1024,
               dynamic_ncols=True, file=sys.stderr, leave=True, postfix="freed 0 B")
    try:
        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

        def freed(n: int) -> None:
            bar.set_postfix_str(f"freed {fmt_bytes(n)}")
        yield update, freed
    finally:
        bar.close()
