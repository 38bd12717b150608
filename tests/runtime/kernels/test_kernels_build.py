"""The native kernels' build folder survives a build that was stopped: torch's lock file, left
behind by a killed build, no longer makes every later load wait for it forever; a build is
announced with its progress, and a missing compiler is said once, loudly; a loaded build is
told what kernels.cpu knows of the CPU."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from expertfs.runtime import kernels
from expertfs.runtime.kernels import build

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="native kernels not built here")


@needs_kernels
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


def _fresh(monkeypatch):
    monkeypatch.setattr(build, "_state", {"module": None, "tried": False, "reason": None,
                                          "seconds": None, "build_dir": None})


def test_no_compiler_is_one_warning_naming_reason_and_consequence(monkeypatch, caplog):
    _fresh(monkeypatch)
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    monkeypatch.delenv("EXPERTFS_NATIVE", raising=False)
    with caplog.at_level(logging.INFO, logger=build.log.name):
        assert build.load() is None
        assert build.load() is None                     # said once, not at every call
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1
    msg = warns[0].getMessage()
    assert "no C++ compiler" in msg and "torch paths" in msg and "slower" in msg
    assert "no C++ compiler" in build.status()["reason"]


def test_a_build_is_announced_with_progress_and_an_end(monkeypatch, caplog, tmp_path):
    _fresh(monkeypatch)
    monkeypatch.setenv("EXPERTFS_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_why_not", lambda: None)
    monkeypatch.setattr(build, "PROGRESS_S", 0.05)
    from torch.utils import cpp_extension

    from expertfs.runtime.kernels import iq_tables
    fake = types.SimpleNamespace(info=lambda: {"isa": "fake"})

    def fake_load(**kw):
        time.sleep(0.3)
        return fake
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(iq_tables, "install", lambda mod: None)
    with caplog.at_level(logging.INFO, logger=build.log.name):
        assert build.load() is fake
    text = [r.getMessage() for r in caplog.records]
    assert text[0].startswith("building the native CPU kernels") and "minutes" in text[0]
    assert any(t.startswith("still building") for t in text)
    assert any(t.startswith("native CPU kernels built in") for t in text)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


_KILLED = """
import os, sys, time
from pathlib import Path
from expertfs.runtime.kernels import build
from torch.utils import cpp_extension
def fake_load(build_directory, **kw):
    (Path(build_directory) / "lock").write_text("")   # what torch's builder holds
    print("building", flush=True)
    time.sleep(120)
build._why_not = lambda: None
cpp_extension.load = fake_load
build.load()
"""


def test_a_build_killed_midway_leaves_no_lock_that_blocks(tmp_path):
    env = dict(os.environ, EXPERTFS_KERNEL_CACHE=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", _KILLED], env=env, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "building"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    (bdir,) = list(tmp_path.iterdir())
    assert (bdir / "lock").exists()                     # torch's, left by the killed build
    code = ("import sys; from pathlib import Path; from expertfs.runtime.kernels import build\n"
            "with build._build_lock(Path(sys.argv[1])): pass")
    r = subprocess.run([sys.executable, "-c", code, str(bdir)], timeout=60, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]          # the kernel lock died with its holder
    assert not (bdir / "lock").exists()                 # and torch's is cleared


@needs_kernels
def test_a_loaded_build_is_told_the_cpu_as_kernels_cpu_sees_it():
    # the float panel's token tails follow cpu.splits_512, handed over at load (build.configure)
    from expertfs.runtime.kernels.cpu import splits_512
    assert build.load().info()["splits_512"] == splits_512()
