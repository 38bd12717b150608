"""The native kernels' build folder survives a build that was stopped: torch's lock file, left
behind by a killed build, no longer makes every later load wait for it forever."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from expertfs.runtime import kernels
from expertfs.runtime.kernels import build

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels not built here")


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    bdir = build.cache_dir() / build._build_name()
    lock = bdir / "lock"
    lock.write_text("")                                  # as a killed build leaves it
    code = ("import sys; from expertfs.runtime.kernels import build; "
            "sys.exit(0 if build.load() is not None else 1)")
    r = subprocess.run([sys.executable, "-c", code], timeout=600, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not lock.exists()
    assert (bdir / "expertfs.lock").exists()


def test_another_checkout_builds_in_a_folder_of_its_own(monkeypatch):
    monkeypatch.setattr(build, "SOURCES", ())          # the name without reading sources
    monkeypatch.setattr(build, "HEADERS", ())
    here = build._build_name()
    monkeypatch.setattr(build, "CSRC", Path("/elsewhere/runtime/kernels/csrc"))
    assert build._build_name() != here
