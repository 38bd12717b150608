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


def assert_thread_independent(experts: tuple, types: tuple, ff: int, raw, raw_type,
                              shape: tuple[int, int]) -> None:
    """``moe`` (both numerics) and a several-token ``matvec`` give the same bits on 1 and 2
    threads: the kernels' work split never changes an accumulation order."""
    import torch

    from expertfs.runtime import kernels
    gate, up, down = experts
    D = shape[1]
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(1))
    w = torch.rand(len(gate), generator=torch.Generator().manual_seed(2))
    old = torch.get_num_threads()
    out = {}
    try:
        for th in (1, 2):
            torch.set_num_threads(th)
            out[th] = [kernels.moe(x, w, gate, up, down, types, ff, aq) for aq in ("off", "q8")]
            out[th] += [kernels.matvec(x.expand(3, D).contiguous(), raw, raw_type, shape)]
    finally:
        torch.set_num_threads(old)
    for a, b in zip(out[1], out[2]):
        assert torch.equal(a, b)


def moe_in_parts(x, w, experts: tuple, types: tuple, ff: int, aq: str, first: list[int]):
    """A layer computed in two parts as a decode step with misses does it (``first``'s experts,
    then the others: ``moe_hidden`` and ``moe_down_rows`` for each, ``moe_combine`` in routing
    order). Returns the two parts, their down rows and the combined output."""
    import torch

    from expertfs.runtime import kernels
    gate, up, down = experts
    n, D = len(gate), x.shape[1]
    parts = (first, [j for j in range(n) if j not in first])
    vs = []
    for part in parts:
        h = kernels.moe_hidden(x, [gate[j] for j in part],
                               None if up is None else [up[j] for j in part], types[:2], ff, aq)
        vs.append(kernels.moe_down_rows(h, [down[j] for j in part], types[2], D, aq))
    row = {j: i for i, j in enumerate(parts[0] + parts[1])}
    return parts, vs, kernels.moe_combine(torch.cat(vs), w, [row[j] for j in range(n)])
