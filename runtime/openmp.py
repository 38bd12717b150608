"""The OpenMP wait policy this runtime runs torch with, set explicitly before torch loads.

How torch's OpenMP threads wait between parallel ops matters here: spinning long starves the
I/O and prefetch threads the runtime depends on and collapses when any other process wants a
core, while purely passive waits put a thread wake-up in front of every parallel op, hundreds
of them per token. So with GNU OpenMP (torch's Linux wheels) threads spin ``SPIN_ROUNDS``
(a few microseconds), then sleep; elsewhere (Intel OpenMP) waits stay passive. The trade-off's
measurements are in bench/README.md.

``configure()`` takes effect only before torch loads OpenMP, so the CLI calls it first thing and
so do the benchmarks and the test suite; a library user calls it before importing torch. The
user's own setting of any of these variables wins. ``peer_environ()`` is this process's
environment without what ``configure`` set, for running a peer program with its own defaults.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["SPIN_ROUNDS", "configure", "peer_environ"]

SPIN_ROUNDS = "10000"
_USER = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")

#: What ``configure`` put in the environment (the rest is the user's).
_SET: dict[str, str] = {}


def _torch_uses_gomp() -> bool:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    locs = list(spec.submodule_search_locations or []) if spec else []
    try:
        return bool(locs) and any(n.startswith("libgomp")
                                  for n in os.listdir(os.path.join(locs[0], "lib")))
    except OSError:
        return False


def configure() -> dict[str, str]:
    """Set the wait policy unless the user set one; returns what this process set."""
    if _SET or any(os.environ.get(k) for k in _USER):
        return dict(_SET)
    os.environ.pop("OMP_WAIT_POLICY", None)              # an empty one would be invalid
    if _torch_uses_gomp():
        _SET["GOMP_SPINCOUNT"] = SPIN_ROUNDS
    else:
        _SET["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.update(_SET)
    return dict(_SET)


def peer_environ() -> dict[str, str]:
    """This process's environment without what ``configure`` set: for running a peer program."""
    return {k: v for k, v in os.environ.items() if _SET.get(k) != v}
