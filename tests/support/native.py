"""The native kernels as the kernel tests drive them: the loaded module (None when it could not
be built, and then ``NEEDS_NATIVE`` skips), the ISAs this CPU can run, and the ``isa`` fixture
that forces one for a test and restores the best afterwards."""

from __future__ import annotations

import pytest

from expertfs.runtime import kernels

MOD = kernels.load()
NEEDS_NATIVE = pytest.mark.skipif(MOD is None, reason=f"native kernels unavailable: "
                                  f"{kernels.status()['reason']}")


def isas() -> list[str]:
    """Every ISA this CPU runs, the portable one first."""
    best = MOD.info()["best_isa"] if MOD is not None else "scalar"
    return {"scalar": ["scalar"], "avx2": ["scalar", "avx2"],
            "avx512": ["scalar", "avx2", "avx512"]}[best]


@pytest.fixture
def isa(request):
    """``indirect=True`` parametrisation: the kernels run ``request.param``'s code for the test."""
    MOD.set_isa(request.param)
    try:
        yield request.param
    finally:
        MOD.set_isa("best")
