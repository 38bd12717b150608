"""The ``expertfs`` command line: the only place that prints or exits.

Each sub-command is a module in this package with ``register(subparsers)``, which adds its
parser and sets ``func=run`` where ``run(args) -> int`` is the exit status. Modules are found
by name, so a new command is a new file here. ``ExpertfsError`` becomes exit status
``err.exit_code`` (2 for bad input) and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

# Before any command imports torch: the runtime's OpenMP wait policy and the C heap's
# thresholds (they load nothing else).
from ..runtime import heap as _heap, openmp as _openmp  # noqa: I001

_openmp.configure()
_heap.configure()

from .. import __version__
from ..errors import ExpertfsError

#: Order of the commands in ``expertfs --help``; any other module here is appended.
ORDER = ["demo", "synth", "repack", "verify", "inspect", "unpack", "bench_io", "bench_cache",
         "plan", "run", "serve"]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command``'s modules alone (``bench`` is
    ``bench_io`` and ``bench_cache``): a command imports only what it runs, so ``repack`` or
    ``verify`` starts without torch's second of imports. A name no module has gets every
    command, so argparse's error lists them."""
    p = argparse.ArgumentParser(
        prog="expertfs",
        description="Run Mixture-of-Experts LLMs far larger than RAM, experts streamed from NVMe.")
    p.add_argument("--version", action="version", version=f"expertfs {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    names = [n for n in ORDER if n in found] + sorted(n for n in found if n not in ORDER)
    if command is not None:
        names = [n for n in names if n == command or n.startswith(command + "_")] or names
    for name in names:
        mod = importlib.import_module(f"{__name__}.{name}")
        if hasattr(mod, "register"):
            mod.register(sub)
    return p


def _command(argv: list[str]) -> str | None:
    """The command word: the first argument that is not a top-level option (``-v`` and
    ``--version`` take no value); None for ``expertfs`` alone or ``--help``."""
    for a in argv:
        if a in ("-h", "--help"):
            return None
        if not a.startswith("-"):
            return a
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(_command(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if level > logging.INFO:                # a first-run kernel build is shown, with progress
        logging.getLogger("expertfs.runtime.kernels.build.progress").setLevel(logging.INFO)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ExpertfsError as e:
        print(f"expertfs {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"expertfs {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
