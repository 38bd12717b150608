"""``kernels.gemm``: which library multiplies float32 on the CPU, and that it gives F.linear's
product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertfs.runtime.kernels import gemm


@pytest.fixture
def choose(monkeypatch):
    """Re-decide ``gemm.backend()`` under a given CPU and EXPERTFS_GEMM."""
    def pick(vendor: str, flags: str, env: str | None = None, speedup: float = 2.0) -> str:
        monkeypatch.setattr(gemm, "_cpu_flags", lambda: (vendor, frozenset(flags.split())))
        monkeypatch.setattr(gemm, "_onednn_speedup", lambda: speedup)
        if env is None:
            monkeypatch.delenv("EXPERTFS_GEMM", raising=False)
        else:
            monkeypatch.setenv("EXPERTFS_GEMM", env)
        gemm.backend.cache_clear()
        return gemm.backend()
    yield pick
    monkeypatch.undo()
    gemm.backend.cache_clear()


def test_onednn_where_mkl_would_run_avx2_on_an_avx512_cpu_and_onednn_is_faster(choose):
    if gemm._onednn_op() is None:
        pytest.skip("this torch has no oneDNN")
    assert choose("AuthenticAMD", "fma avx2 avx512f avx512bw") == "onednn"
    assert choose("AuthenticAMD", "avx512f", speedup=1.1) == "mkl"   # 512-bit split in two
    assert choose("AuthenticAMD", "fma avx2") == "mkl"
    assert choose("GenuineIntel", "fma avx2 avx512f") == "mkl"
    assert choose("GenuineIntel", "fma avx2", env="onednn") == "onednn"
    assert choose("AuthenticAMD", "avx512f", env="mkl") == "mkl"


def test_an_unknown_override_falls_back_to_the_rule(choose, caplog):
    assert choose("GenuineIntel", "avx2", env="blis") == "mkl"
    assert "EXPERTFS_GEMM=blis" in caplog.text


def test_no_onednn_means_mkl(choose, monkeypatch):
    monkeypatch.setattr(gemm, "_onednn_op", lambda: None)
    assert choose("AuthenticAMD", "avx512f", env="onednn") == "mkl"


@pytest.mark.parametrize("lead", [(1,), (7,), (2, 5), (128,)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_f_linear_within_float32_rounding(choose, lead, bias):
    if gemm._onednn_op() is None:
        pytest.skip("this torch has no oneDNN")
    choose("AuthenticAMD", "avx512f", env="onednn")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*lead, 640, generator=g)
    w = torch.randn(2300, 640, generator=g)           # one-token products above SMALL_ONE_TOKEN too
    b = torch.randn(2300, generator=g) if bias else None
    y = gemm.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (*lead, 2300) and y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() < 1e-3


def test_what_onednn_does_not_take_goes_to_f_linear(choose, monkeypatch):
    choose("AuthenticAMD", "avx512f", env="onednn")
    calls = []
    monkeypatch.setattr(gemm, "_onednn_op", lambda: lambda *a: calls.append(a))
    w = torch.randn(64, 32)
    for x, wt in ((torch.randn(3, 32, dtype=torch.float64), w.double()),   # not float32
                  (torch.randn(3, 32), torch.randn(32, 64).t()),            # a transposed view
                  (torch.randn(0, 32), w),                                  # nothing to multiply
                  (torch.randn(1, 32), w)):                                 # one small product
        assert torch.equal(gemm.linear(x, wt), F.linear(x, wt))
    assert not calls


def test_the_timing_compares_the_two_libraries():
    if gemm._onednn_op() is None:
        pytest.skip("this torch has no oneDNN")
    assert 0 < gemm._onednn_speedup() < float("inf")
