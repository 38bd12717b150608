"""Compile (once) and load the native kernels: a torch C++ extension built from ``csrc/``.

The sources are compiled at first use with ``torch.utils.cpp_extension.load`` into a per-user
cache folder (``$EXPERTFS_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/expertfs/kernels``, else
``~/.cache/expertfs/kernels``), one sub-folder per hash of the sources, the torch version and
the flags and the sources' folder: a later process (or test session) loads the built module in
milliseconds, and an edited source, another torch or another checkout gets its own build (two
checkouts sharing one folder would rebuild it at every switch, since ninja sees other source
paths).
Builds of one folder are serialised by a kernel lock (``flock``, released if the builder dies);
torch's own lock file is left behind by a build that is killed (Ctrl-C during the first run,
an out-of-memory kill) and would make every later load wait for it forever, so the holder of
the kernel lock removes it. The build needs a C++ compiler (``$CXX`` or
``c++``) and ninja; without them, or when ``EXPERTFS_NATIVE=0``, or when the build fails,
``load()`` returns None, the reason is logged once (warning) and kept in ``status()``, and the
runtime uses its torch paths. A real build (no module in the folder yet) is announced at INFO
(what, why, how long it usually takes), with an elapsed-time line every ``PROGRESS_S`` seconds
and an end line; the CLI shows these records (``make setup`` builds the kernels ahead).

``EXPERTFS_KERNELS_EMULATE_AVX512=1`` builds a test module whose AVX-512 units run on SIMDe's
emulation (``csrc/avx512_emulated.h``; a folder of its own): their results on a CPU without
AVX-512, for the tests, never their speed.

The code is portable C++ plus an AVX2+FMA+F16C unit and an AVX-512 (F+VL) unit whose
functions carry target attributes, so one build runs on any x86-64 CPU; the CPU is checked
when the module loads and the best tier it supports is used (a tier falls back to the one
below for the types it has no kernel of).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["load", "configure", "status", "cache_dir", "SOURCES"]

log = logging.getLogger(__name__)
#: The first-run build's start, progress and end lines (the CLI shows these at its default
#: verbosity: a build takes minutes and would otherwise look like a hang).
progress = logging.getLogger(__name__ + ".progress")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops.cpp", "small_ops.cpp", "mix_ops.cpp", "kern_scalar.cpp", "kern_avx2.cpp",
           "kern_avx512.cpp", "kern_iq.cpp", "kern_iq_avx2.cpp", "kern_iq_avx512.cpp",
           "kern_k_avx512.cpp", "qgemm.cpp", "qgemm_q8.cpp", "qgemm_amx.cpp")
HEADERS = ("kern.h", "pool.h", "small_ops.h", "kern_avx2_util.h", "kern_iq_avx2_types.h",
           "kern_k_avx2.h", "kern_avx512_pair.h", "avx512_emulated.h", "qpanel_rows.h",
           "transpose16.h", "kern_q6_k_r.h", "kern_q45_z.h")
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unused-function",
          "-Wno-maybe-uninitialized")     # GCC 12 false positives in its AVX-512 headers

#: the emulated-AVX-512 test build's (``emulate_avx512()``): AVX2, FMA and F16C for the whole
#: module, so that SIMDe computes each 512-bit operation as two of the 256-bit ones the AVX2
#: kernels use (its portable code would round a multiply-add twice, not once); -Wno-psabi: SIMDe
#: passes 512-bit vectors by value, of whose ABI GCC would note at every such call
EMULATE_CFLAGS = ("-DEFS_EMULATE_AVX512", "-mavx2", "-mfma", "-mf16c", "-Wno-psabi")
EMULATE_HEADER = "simde/x86/avx512.h"

PROGRESS_S = 20.0                 # seconds between "still building" lines

_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "tried": False, "reason": None, "seconds": None,
                          "build_dir": None}


def cache_dir() -> Path:
    env = os.environ.get("EXPERTFS_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "expertfs" / "kernels"


def _build_name() -> str:
    import torch
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        h.update(f.encode())
        h.update((CSRC / f).read_bytes())
    h.update(" ".join(_cflags()).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(str(CSRC).encode())
    return "expertfs_kernels_" + h.hexdigest()[:16]


def emulate_avx512() -> bool:
    """Whether this process builds and loads the emulated-AVX-512 test module."""
    return os.environ.get("EXPERTFS_KERNELS_EMULATE_AVX512", "").strip().lower() in (
        "1", "on", "yes", "true")


def _cflags() -> tuple[str, ...]:
    return CFLAGS + EMULATE_CFLAGS if emulate_avx512() else CFLAGS


@functools.cache
def simde_available() -> bool:
    """Whether the C++ compiler finds SIMDe's AVX-512 header (Debian: libsimde-dev); one
    compile of it (about 2 s), once per process."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return False
    r = subprocess.run([cxx, "-x", "c++", "-fsyntax-only", "-"],
                       input=f"#include <{EMULATE_HEADER}>\n", capture_output=True, text=True)
    return r.returncode == 0


def _why_not() -> str | None:
    """Why the extension cannot be built here, or None."""
    if os.environ.get("EXPERTFS_NATIVE", "1").strip().lower() in ("0", "off", "no", "false"):
        return "disabled by EXPERTFS_NATIVE=0"
    missing = [f for f in SOURCES + HEADERS if not (CSRC / f).is_file()]
    if missing:
        return f"kernel sources missing from the installation: {', '.join(missing)}"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found; install g++ or set CXX)"
    from torch.utils import cpp_extension
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    if emulate_avx512() and not simde_available():
        return (f"EXPERTFS_KERNELS_EMULATE_AVX512 needs SIMDe's {EMULATE_HEADER} "
                "(apt-get install libsimde-dev)")
    return None


@contextlib.contextmanager
def _build_lock(bdir: Path):
    """Hold ``bdir``'s build lock (released when the file closes, or the process dies): wait for
    another process building there, then clear torch's lock file if a killed build left it (no
    live builder can hold it while we hold ours)."""
    with open(bdir / "expertfs.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress.info("waiting for another process building the native kernels in %s", bdir)
            fcntl.flock(f, fcntl.LOCK_EX)
        stale = bdir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that was stopped", stale)
            stale.unlink(missing_ok=True)
        yield


def _short(e: BaseException) -> str:
    """The first compiler diagnostic of a failed build (else the exception's first line)."""
    text = str(e).strip()
    lines = text.splitlines()
    diag = [ln for ln in lines if ": error:" in ln or ": fatal error:" in ln]
    return f"{type(e).__name__}: {(diag or lines or [''])[0][:300]}"


@contextlib.contextmanager
def _announce(bdir: Path, name: str):
    """Log a build's start, its progress from a timer thread, and its end."""
    if (bdir / f"{name}.so").exists():            # already built: a load, not a build
        yield
        return
    progress.info("building the native CPU kernels (C++, %d sources) into %s: the first run for "
             "this torch and source version compiles them once, usually in one to two minutes; "
             "later runs load them in a moment", len(SOURCES), bdir)
    t0, done = time.perf_counter(), threading.Event()

    def tick() -> None:
        while not done.wait(PROGRESS_S):
            progress.info("still building the native CPU kernels (%.0f s so far)",
                     time.perf_counter() - t0)
    th = threading.Thread(target=tick, name="expertfs-kernel-build", daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join()
    progress.info("native CPU kernels built in %.0f s", time.perf_counter() - t0)


def configure(mod: ModuleType) -> None:
    """Hand a freshly loaded build what it does not find out itself: the IQ codebooks (from
    gguf-py) and what its kernels follow of the CPU (``cpu.splits_512``; a build from before
    ``set_cpu``, as a benchmark's A/B may load, has none to take)."""
    from .cpu import splits_512
    from .iq_tables import install
    install(mod)
    if hasattr(mod, "set_cpu"):
        mod.set_cpu(splits_512())


def load() -> ModuleType | None:
    """The compiled module, building it on first use; None when unavailable (reason logged
    once, see ``status()``)."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if _state["tried"]:
            return _state["module"]
        mod, reason = None, _why_not()
        if reason is None:
            t0 = time.perf_counter()
            try:
                from torch.utils import cpp_extension
                name = _build_name()
                bdir = cache_dir() / name
                bdir.mkdir(parents=True, exist_ok=True)
                _state["build_dir"] = str(bdir)
                with _build_lock(bdir), _announce(bdir, name):
                    mod = cpp_extension.load(name=name, sources=[str(CSRC / f) for f in SOURCES],
                                             extra_cflags=list(_cflags()),
                                             build_directory=str(bdir), verbose=False)
                configure(mod)
            except Exception as e:  # noqa: BLE001 - any toolchain failure means "use torch"
                mod, reason = None, f"build failed ({_short(e)})"
            _state["seconds"] = time.perf_counter() - t0
        _state["module"], _state["reason"] = mod, reason
        _state["tried"] = True
        if mod is None:
            log.warning("native CPU kernels unavailable: %s; using the torch paths instead "
                        "(correct, but decoding is slower)", reason)
        else:
            info = mod.info()
            log.info("native CPU kernels loaded (%s, %.1f s) from %s", info["isa"],
                     _state["seconds"], _state["build_dir"])
        return mod


def status() -> dict[str, Any]:
    """Whether the kernels are loaded, why not, the ISA in use, the build folder and time."""
    mod = _state["module"]
    out = {"available": mod is not None, "tried": _state["tried"], "reason": _state["reason"],
           "build_dir": _state["build_dir"], "build_seconds": _state["seconds"]}
    if mod is not None:
        out.update(mod.info())
    return out
