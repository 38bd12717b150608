"""The OpenMP wait policy is set by an explicit call, never by importing the runtime."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import os, sys
before = dict(os.environ)
import expertfs.runtime, expertfs.runtime.engine
assert dict(os.environ) == before, "importing the runtime changed the environment"
from expertfs.runtime.openmp import configure, peer_environ
got = configure()
assert got and all(os.environ[k] == v for k, v in got.items()), got
assert configure() == got                                  # idempotent
peer = peer_environ()
assert not any(peer.get(k) == v for k, v in got.items()), peer
print("OK", sorted(got))
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=120)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}


def test_configure_sets_a_policy_and_peer_environ_removes_it():
    out = _run(_clean_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("OK")


def test_a_users_own_setting_wins():
    env = dict(_clean_env(), OMP_WAIT_POLICY="ACTIVE")
    code = ("import os\nfrom expertfs.runtime.openmp import configure\n"
            "assert configure() == {}\nassert os.environ['OMP_WAIT_POLICY'] == 'ACTIVE'\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
