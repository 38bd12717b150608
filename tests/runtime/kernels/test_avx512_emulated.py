"""The AVX-512 kernels checked on a CPU without AVX-512: the kernel tests (those that compare the
AVX-512 kernels with the AVX2 ones bit for bit and with the reference, and the rest with
AVX-512 as the best ISA) run again in a process whose kernels are built with
``EXPERTFS_KERNELS_EMULATE_AVX512=1``, their 512-bit operations emulated by SIMDe
(``csrc/avx512_emulated.h``). Needs SIMDe's headers (Debian:
``libsimde-dev``); skipped where the CPU has AVX-512 (the same tests run natively there) or the
headers are missing. The first run builds the emulated module (minutes, once per source
version, in a folder of its own)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from expertfs.runtime.kernels import build
from support.native import MOD, NEEDS_NATIVE

HERE = Path(__file__).resolve().parent

NATIVE_512 = MOD is not None and MOD.info()["best_isa"] == "avx512"

pytestmark = [
    NEEDS_NATIVE,
    pytest.mark.skipif(NATIVE_512, reason="this CPU runs the AVX-512 kernels natively"),
    pytest.mark.skipif(not NATIVE_512 and not build.simde_available(),   # no compile where native
                       reason="SIMDe's headers are not installed (apt-get install libsimde-dev)"),
]

#: not run again under emulation: this file, and the build tests (folders, locks, compilers)
SKIP = ("test_avx512_emulated.py", "test_kernels_build.py")


def test_the_kernel_tests_pass_with_avx512_emulated():
    env = dict(os.environ, EXPERTFS_KERNELS_EMULATE_AVX512="1")
    code = ("from expertfs.runtime import kernels; m = kernels.load(); "
            "print('ISA', m.info()['best_isa'] if m else kernels.status()['reason'], "
            "'emulated' if m and m.info()['avx512_emulated'] else '')")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0 and "ISA avx512 emulated" in r.stdout, (r.stdout + r.stderr)[-3000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        str(HERE), *(f"--ignore={HERE / f}" for f in SKIP)], env=env,
                       capture_output=True, text=True, timeout=3600, cwd=HERE.parents[2])
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) > 0, tail
    assert "no AVX-512" not in r.stdout, tail
