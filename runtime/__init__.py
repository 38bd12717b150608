"""The engine: I/O backends, cache tiers, policies, predictors, the MoE forward pass."""

import importlib.util as _util
import os as _os

# How torch's OpenMP threads wait between parallel ops. Spinning long starves the I/O and
# prefetch threads this runtime depends on and collapses when any other process wants a core:
# measured here, a 51-token prefill took 112 s with GNU OpenMP's default wait (spinning ~300k
# rounds) and 12 s with passive waits. Passive waits instead put a thread wake-up (in a VM, a
# halted vCPU woken by the host) in front of every parallel op, hundreds of them per token:
# resident decode of a 6.4 GB qwen3moe on 2 threads took 153-169 ms/token passive against
# 112-144 ms/token spinning 1000-30000 rounds (a few microseconds) before sleeping. So with GNU
# OpenMP (torch's Linux wheels) threads spin SPIN_ROUNDS, then sleep; elsewhere (Intel OpenMP)
# waits stay passive. It only takes effect if set before torch loads OpenMP; the user's own
# setting wins.
SPIN_ROUNDS = "10000"
_USER = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _torch_uses_gomp() -> bool:
    try:
        spec = _util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    locs = list(spec.submodule_search_locations or []) if spec else []
    try:
        return bool(locs) and any(n.startswith("libgomp")
                                  for n in _os.listdir(_os.path.join(locs[0], "lib")))
    except OSError:
        return False


#: What this import put in the environment (the rest is the user's): benchmarks remove it from
#: a peer's environment (llama.cpp uses GNU OpenMP too), so the peer runs with its own defaults.
OPENMP_ENV_SET: dict[str, str] = {}
if not any(_os.environ.get(k) for k in _USER):
    _os.environ.pop("OMP_WAIT_POLICY", None)              # an empty one would be invalid
    if _torch_uses_gomp():
        OPENMP_ENV_SET["GOMP_SPINCOUNT"] = SPIN_ROUNDS
    else:
        OPENMP_ENV_SET["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ.update(OPENMP_ENV_SET)


def peer_environ() -> dict[str, str]:
    """This process's environment without what this module set: for running a peer program."""
    return {k: v for k, v in _os.environ.items() if OPENMP_ENV_SET.get(k) != v}
