"""Helpers shared by the command modules: progress bars, JSON output, size and --mtp
arguments."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..errors import UsageError
from ..units import parse_size

__all__ = ["mtp_arg", "progress_bar", "print_json", "size_arg"]


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def mtp_arg(text: str) -> int | str:
    """``run --mtp``: a draft depth (0: off) or ``"auto"``; read by ``run`` for its engine and
    by the tier sizing (a NextN block is loaded, and counted, only to draft)."""
    if text == "auto":
        return "auto"
    try:
        k = int(text)
    except ValueError:
        raise UsageError(f"--mtp {text!r}", fix="give a draft depth (e.g. 2), 0 (off) or auto") \
            from None
    if k < 0:
        raise UsageError(f"--mtp {k}", fix="give a draft depth >= 1, 0 (off) or auto")
    return k


@contextmanager
def progress_bar(desc: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback drawing a tqdm bar (bytes, rate, ETA) on a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield lambda done, total: None
        return
    from tqdm import tqdm
    bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
               file=sys.stderr, leave=True)
    try:
        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)
        yield update
    finally:
        bar.close()


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")
