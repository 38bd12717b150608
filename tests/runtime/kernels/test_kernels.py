"""Native CPU kernels (runtime.kernels): exact mode equals F.linear on gguf-py's dequantized
weights; q8 mode equals llama.cpp's numerics, rebuilt here independently in numpy (ggml's
quantize_row_q8_K_ref, its x86 quantize_row_q8_0/q8_1, fp16/bf16 rounding); the one-call MoE
layer equals the expert loop; the portable and AVX2 code agree; results do not depend on the
thread count. The extension is compiled once per user (cached); the module is skipped with the
loader's reason when no C++ toolchain is present.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import quants

from expertfs.formats.dequant import dequantize
from expertfs.formats.ggml import type_size
from expertfs.runtime import kernels
from expertfs.runtime.kernels import gemm as _gemm  # noqa: F401  (kernels.gemm, used below)
from support.native import (MOD, NEEDS_NATIVE, assert_thread_independent,  # noqa: F401
                            isa, isas, moe_in_parts)                 # (isa: a fixture)

pytestmark = NEEDS_NATIVE

ALL = [T.Q4_K, T.Q6_K, T.Q5_K, T.Q8_0, T.Q4_0, T.Q2_K, T.Q3_K, T.IQ4_XS, T.MXFP4, T.Q5_0,
       T.Q5_1, T.Q4_1, T.BF16, T.F16]
_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
               T.IQ4_XS: (0,)}
_Q8_1 = (T.Q4_1, T.Q5_1)
_K = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)


def weight(t: T, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid ggml bytes of a ``rows × cols`` matrix: gguf-py's quantization of random floats,
    or random blocks with small finite fp16 scales for the types gguf-py cannot quantize."""
    rng = np.random.default_rng(seed)
    if t in _F16_FIELDS:
        b = rng.integers(0, 256, (rows, cols // 256, type_size(t)), dtype=np.uint8)
        for off in _F16_FIELDS[t]:
            b[..., off:off + 2] = (rng.standard_normal(b.shape[:2]) * 0.01).astype(
                np.float16).view(np.uint8).reshape(*b.shape[:2], 2)
        return torch.from_numpy(b.reshape(-1))
    q = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), t)
    return torch.from_numpy(np.ascontiguousarray(q).view(np.uint8).reshape(-1).copy())


def cols_for(t: T) -> list[int]:
    if t in _K:
        return [256, 768]
    if t in (T.F16, T.BF16):
        return [100, 512]                     # 100: a tail that is not a whole vector
    return [96, 512]


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float rounding allowance: a few ulps of sum |x| |w| per output."""
    return 4e-6 * (x.double().abs() @ w.double().abs().T).float() + 1e-30


# --- llama.cpp's activation quantizers, written independently in numpy -----------------------

def q8k_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml quantize_row_q8_K_ref: d (f32), qs (i8) and bsums (i16) per 256 elements."""
    xb = x.astype(np.float32).reshape(-1, 256)
    idx = np.abs(xb).argmax(1)                     # the first element of largest magnitude
    mx = xb[np.arange(len(xb)), idx]
    d = np.zeros(len(xb), np.float32)
    q = np.zeros(xb.shape, np.int8)
    nz = mx != 0
    iscale = (np.float32(-127.0) / mx[nz]).astype(np.float32)
    v = np.rint((iscale[:, None] * xb[nz]).astype(np.float32))     # nearest_int: half to even
    q[nz] = np.minimum(127, v).astype(np.int8)
    d[nz] = (np.float32(1.0) / iscale).astype(np.float32)
    bs = q.reshape(len(xb), 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    return d, q, bs


def qx8_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml-cpu x86 quantize_row_q8_0 / q8_1: fp16-rounded d, qs, fp16-rounded s = d·Σqs."""
    xb = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(xb).max(1)
    d = (amax / np.float32(127)).astype(np.float32)
    idv = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    q = np.rint((xb * idv[:, None]).astype(np.float32)).astype(np.int32)
    s = (d * q.sum(1).astype(np.float32)).astype(np.float16).astype(np.float32)
    return d.astype(np.float16).astype(np.float32), q, s


def llama_q8(x: torch.Tensor, raw: torch.Tensor, t: T, rows: int, cols: int) -> torch.Tensor:
    """``x @ W.T`` with llama.cpp's activation quantization, from dequantized weights."""
    W = dequantize(raw, t, (rows, cols)).double()
    out = []
    for xr in x.numpy():
        if t in _K:
            d, q, _ = q8k_numpy(xr)
            xq = (d[:, None] * q).reshape(-1)
            y = W @ torch.from_numpy(xq.astype(np.float64))
        elif t == T.F16:
            y = W @ torch.from_numpy(xr.astype(np.float16).astype(np.float64))
        elif t == T.BF16:
            y = W @ torch.from_numpy(xr).to(torch.bfloat16).double()
        else:
            d, q, s = qx8_numpy(xr)
            xq = (d[:, None].astype(np.float64) * q).reshape(-1)
            y = W @ torch.from_numpy(xq)
            if t in _Q8_1:        # the m·s term uses s, not d·Σq: m_w · (s - d·Σq) per block
                m = raw.numpy().reshape(rows, cols // 32, type_size(t))[..., 2:4].copy()
                m = m.view(np.float16).astype(np.float64)[..., 0]      # [rows, blocks]
                y = y + torch.from_numpy(m @ (s.astype(np.float64) - d * q.sum(1)))
        out.append(y)
    return torch.stack(out).float()


# --- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_exact_equals_dequant_linear(t, isa):
    for k, cols in enumerate(cols_for(t)):
        rows = 37 + 8 * k
        raw = weight(t, rows, cols, int(t) * 7 + k)
        W = dequantize(raw, t, (rows, cols))
        for nt in (1, 3, 6, 13):       # 6, 13: the several-token kernels (8 per pass)
            x = torch.randn(nt, cols, generator=torch.Generator().manual_seed(nt + k))
            got = kernels.matvec(x, raw, t, (rows, cols))
            ref = F.linear(x, W)
            assert got.shape == (nt, rows)
            assert ((got - ref).abs() <= bound(x, W)).all(), (t.name, isa, cols, nt)


@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("t", [T.Q2_K, T.Q3_K, T.Q4_K, T.IQ4_XS], ids=lambda t: t.name)
def test_table_lookup_kernels_on_wide_rows(t, isa):
    """Rows whose passes' activations overflow the L1 cache (one or two tokens past 16 KiB,
    Q3_K, Q4_K and IQ4_XS passes of more past 32 KiB) go two at a time through the AVX-512
    table-lookup kernels (an odd last row alone): the dequantized product within the rounding
    bound, and each token's result that of the token alone."""
    rows, cols = 13, 4608
    raw = weight(t, rows, cols, int(t) + 300)
    W = dequantize(raw, t, (rows, cols))
    x = torch.randn(8, cols, generator=torch.Generator().manual_seed(31))
    alone = [kernels.matvec(x[i:i + 1], raw, t, (rows, cols)) for i in range(8)]
    for nt in (1, 2, 3, 4, 5, 8):
        got = kernels.matvec(x[:nt], raw, t, (rows, cols))
        assert ((got - F.linear(x[:nt], W)).abs() <= bound(x[:nt], W)).all(), (isa, nt)
        assert torch.equal(got, torch.cat(alone[:nt])), (isa, nt)


@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_q8_equals_llama_numerics(t, isa):
    cols = 512
    rows = 29
    raw = weight(t, rows, cols, int(t) + 100)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(int(t)))
    x[1, 5] = 0.0
    x[1, 256:288] = 0.0                               # an all-zero block
    got = kernels.matvec(x, raw, t, (rows, cols), act_quant="q8")
    ref = llama_q8(x, raw, t, rows, cols)
    W = dequantize(raw, t, (rows, cols))
    assert ((got - ref).abs() <= bound(x, W) + 1e-6 * ref.abs()).all(), (t.name, isa)
    exact = kernels.matvec(x, raw, t, (rows, cols))
    assert not torch.equal(got, exact) or t in (T.F16, T.BF16)   # the mode is really on


def test_q8k_quantizer_bytes_equal_ggml_reference():
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5)) * 3
    x[1, :256] = 0.0                                   # amax == 0: d = 0, qs = 0
    x[2, 7], x[2, 9] = 4.0, -4.0                       # a tie: the first one sets the sign
    for name in isas():
        MOD.set_isa(name)
        try:
            b = MOD.quantize_q8k_bytes(x).numpy().reshape(3, 2, 292)
        finally:
            MOD.set_isa("best")
        for r in range(3):
            d, q, bs = q8k_numpy(x[r].numpy())
            assert np.array_equal(b[r, :, :4].copy().view(np.float32)[:, 0], d), name
            assert np.array_equal(b[r, :, 4:260].view(np.int8), q), name
            assert np.array_equal(b[r, :, 260:].copy().view(np.int16), bs), name


def test_act_dequant_is_what_q8_multiplies():
    raw = weight(T.Q4_K, 16, 256, 3)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(8))
    xq = MOD.act_dequant(x, int(T.Q4_K))
    d, q, _ = q8k_numpy(x[0].numpy())
    assert torch.equal(xq[0], torch.from_numpy((d[:, None] * q).reshape(-1).astype(np.float32)))
    got = kernels.matvec(x, raw, T.Q4_K, (16, 256), act_quant="q8")
    ref = F.linear(xq, dequantize(raw, T.Q4_K, (16, 256)))
    assert torch.allclose(got, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)


def _experts(types, n, D, ff, fused, seed):
    tg, tu, td = types
    gate = [weight(tg, 2 * ff if fused else ff, D, seed + j) for j in range(n)]
    up = None if fused else [weight(tu, ff, D, seed + 50 + j) for j in range(n)]
    down = [weight(td, D, ff, seed + 100 + j) for j in range(n)]
    return gate, up, down


def _loop(x, w, gate, up, down, types, D, ff, act_quant):
    tg, tu, td = types
    out = torch.zeros(1, D)
    for j in range(len(gate)):
        if up is None:
            g, u = kernels.matvec(x, gate[j], tg, (2 * ff, D), act_quant).chunk(2, -1)
        else:
            g = kernels.matvec(x, gate[j], tg, (ff, D), act_quant)
            u = kernels.matvec(x, up[j], tu, (ff, D), act_quant)
        h = F.silu(g) * u
        out += w[j] * kernels.matvec(h, down[j], td, (D, ff), act_quant)
    return out


@pytest.mark.parametrize("types,fused", [((T.Q4_K, T.Q4_K, T.Q6_K), False),
                                         ((T.Q8_0, T.Q8_0, T.Q4_0), False),
                                         ((T.MXFP4, T.MXFP4, T.MXFP4), True),
                                         ((T.Q5_K, T.Q4_K, T.Q8_0), False)],
                         ids=["q4k-q6k", "q8_0-q4_0", "mxfp4-fused", "mixed"])
def test_moe_equals_expert_loop(types, fused):
    D, ff, n = 512, 256, 5
    gate, up, down = _experts(types, n, D, ff, fused, 11)
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(4))
    w = torch.tensor([0.4, 0.25, 0.15, 0.12, 0.08])
    for aq in ("off", "q8"):
        got = kernels.moe(x, w, gate, up, down, types, ff, aq)
        ref = _loop(x, w, gate, up, down, types, D, ff, aq)
        assert torch.allclose(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=0), aq
    # exact mode against float weights, independently of the kernels
    tg, tu, td = types
    ref = torch.zeros(1, D)
    for j in range(n):
        if fused:
            g, u = F.linear(x, dequantize(gate[j], tg, (2 * ff, D))).chunk(2, -1)
        else:
            g = F.linear(x, dequantize(gate[j], tg, (ff, D)))
            u = F.linear(x, dequantize(up[j], tu, (ff, D)))
        ref += w[j] * F.linear(F.silu(g) * u, dequantize(down[j], td, (D, ff)))
    got = kernels.moe(x, w, gate, up, down, types, ff)
    assert torch.allclose(got, ref, atol=2e-5 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("types,fused", [((T.Q4_K, T.Q4_K, T.Q6_K), False),
                                         ((T.Q8_0, T.Q8_0, T.Q4_0), False),
                                         ((T.MXFP4, T.MXFP4, T.MXFP4), True)],
                         ids=["q4k-q6k", "q8_0-q4_0", "mxfp4-fused"])
@pytest.mark.parametrize("aq", ["off", "q8"])
@pytest.mark.parametrize("isa", isas(), indirect=True)
def test_moe_in_parts_equals_one_call_bit_for_bit(types, fused, aq, isa):
    """Some experts' gate/up and down rows first, the others' later, summed in routing order by
    moe_combine: the one-call moe's bits (what a decode step does while misses load)."""
    D, ff, n = 512, 256, 6
    gate, up, down = _experts(types, n, D, ff, fused, 21)
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(5))
    w = torch.rand(n, generator=torch.Generator().manual_seed(6))
    want = kernels.moe(x, w, gate, up, down, types, ff, aq)
    for first in ([0, 2, 3], [5], [1, 2, 3, 4, 5]):
        parts, vs, got = moe_in_parts(x, w, (gate, up, down), types, ff, aq, first)
        assert torch.equal(got, want), first
        v = torch.empty(n, D)                                  # rows in routing order
        v[parts[0]], v[parts[1]] = vs
        assert torch.equal(kernels.moe_combine(v, w), want), first


def test_results_do_not_depend_on_threads():
    D, ff, types = 512, 256, (T.Q4_K, T.Q4_K, T.Q6_K)
    assert_thread_independent(_experts(types, 4, D, ff, False, 3), types, ff,
                              weight(T.Q4_K, 300, D, 9), T.Q4_K, (300, D))


def test_not_applicable_and_bad_input():
    raw = weight(T.Q4_K, 8, 256, 1)
    x = torch.randn(1, 256)
    assert kernels.matvec(x.double(), raw, T.Q4_K, (8, 256)) is None
    assert kernels.matvec(x, raw, T.Q8_K, (8, 256)) is None             # no native kernel
    assert kernels.matvec(x[:, :128], weight(T.Q4_0, 8, 128, 2), T.Q4_0, (8, 128),
                          act_quant="q8") is not None
    with pytest.raises(ValueError, match="unknown activation quantization"):
        kernels.matvec(x, raw, T.Q4_K, (8, 256), act_quant="q4")
    with pytest.raises(RuntimeError, match="bytes, expected"):
        kernels.matvec(x, raw[:-1], T.Q4_K, (8, 256))
    with pytest.raises(RuntimeError, match="x must be"):
        MOD.matvec(torch.randn(1, 255), raw, int(T.Q4_K), 8, 256, 0)


def test_disabled_by_environment(monkeypatch):
    from expertfs.runtime.kernels import build
    monkeypatch.setenv("EXPERTFS_NATIVE", "0")
    assert build._why_not() == "disabled by EXPERTFS_NATIVE=0"
    monkeypatch.setenv("EXPERTFS_NATIVE", "1")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert "no C++ compiler" in build._why_not()


def test_pool_concurrent_callers_thread_changes_and_fork():
    """Two Python threads calling at once (one runs serially), the thread count changing
    between calls, and a forked child (a new pool) all give the single-thread results."""
    import multiprocessing as mp
    import threading
    D, ff, n = 512, 256, 4
    types = (T.Q4_K, T.Q4_K, T.Q6_K)
    gate, up, down = _experts(types, n, D, ff, False, 21)
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(5))
    w = torch.rand(n, generator=torch.Generator().manual_seed(6))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = kernels.moe(x, w, gate, up, down, types, ff)
        bad = []

        def caller():
            for _ in range(20):
                if not torch.equal(kernels.moe(x, w, gate, up, down, types, ff), ref):
                    bad.append(1)
        for th in (2, 3, 2):
            torch.set_num_threads(th)
            ts = [threading.Thread(target=caller) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        assert not bad
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(q, x, w, gate, up, down, types, ff, ref))
        p.start()
        p.join(60)
        assert p.exitcode == 0 and q.get(timeout=5) is True
    finally:
        torch.set_num_threads(old)


_REBUILD = """
import torch
from expertfs.runtime import kernels
from expertfs.formats.ggml import GGMLType
kernels.set_threads(2)
raw = torch.zeros(64 * 8 * 18, dtype=torch.uint8)          # Q4_0, 64 rows of 256
x = torch.randn(1, 256)
for i in range(3000):
    kernels.matvec(x, raw, GGMLType.Q4_0, (64, 256))        # a pool, its worker just started
    kernels.set_spin_us(50 + i % 2)                         # ~Pool joins that worker
kernels.set_spin_us(50)
print("done")
"""


def test_a_pool_destroyed_as_soon_as_built_joins_its_workers():
    """``set_spin_us`` rebuilds the pool: one destroyed before its worker thread first ran
    must still stop it (the worker once took the stop's wake-up count as already seen and
    slept through it while ~Pool joined it: ``Engine.close`` hung). In a child, so a hang
    fails the test instead of the suite."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _REBUILD], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr


def _child(q, x, w, gate, up, down, types, ff, ref):
    torch.set_num_threads(2)
    q.put(bool(torch.equal(kernels.moe(x, w, gate, up, down, types, ff), ref)))


def test_every_token_limit_takes_one_token():
    """A decode step's products go native without looking their limit up
    (``qmatvec.decode_matvec``): no table may send one token elsewhere."""
    w = kernels.widths
    tables = [v for k, v in vars(w).items() if k.startswith("WIDE_TYPES") and isinstance(v, dict)]
    assert len(tables) >= 9 and all(n >= 1 for t in tables for n in t.values())


@pytest.mark.parametrize("vendor,family,split", [
    ("AuthenticAMD", 25, True), ("AuthenticAMD", 26, False), ("GenuineIntel", 6, False)])
def test_splits_512_is_read_from_the_cpu_family(tmp_path, vendor, family, split):
    """Zen 4 (AMD family 0x19) runs 512-bit operations as two halves; Zen 5 and Intel do not,
    and Zen 5 has its own q8 limits (``amd_full_512``)."""
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
                    "model\t\t: 17\nflags\t\t: fpu avx2 avx512f\n")
    cpu = kernels.cpu.info(str(info))
    assert kernels.cpu.splits_512(cpu) is split
    assert kernels.cpu.amd_full_512(cpu) is (vendor == "AuthenticAMD" and not split)


def test_max_tokens_follows_the_isa(monkeypatch):
    """The types whose rows kernels beat the panel product at prefill widths take that many
    tokens natively, per kernel ISA, the CPU's 512-bit units (``widths.splits_512``) and
    numerics (``WIDE_TYPES*``), whichever float32 library the box chose; other types and the
    scalar kernels keep the caller's default."""
    w = kernels.widths
    assert kernels.max_tokens(T.F16, 32) == kernels.max_tokens(T.F16, 32, "q8") == 32
    for table in (w.WIDE_TYPES, w.WIDE_TYPES_AVX2, w.WIDE_TYPES_Q8_AVX2, w.WIDE_TYPES_FULL512,
                  w.WIDE_TYPES_Q8_FULL512, w.WIDE_TYPES_Q8_VNNI, w.WIDE_TYPES_Q8_VNNI_SPLIT512,
                  w.WIDE_TYPES_Q8_VNNI_ZEN5):
        assert set(table) <= kernels.TYPES
    for name, split, zen5, ex, q8, vnni in (
            ("avx512", True, False, w.WIDE_TYPES, w.WIDE_TYPES_Q8_FULL512,
             w.WIDE_TYPES_Q8_VNNI_SPLIT512),
            ("avx512", False, False, w.WIDE_TYPES_FULL512, w.WIDE_TYPES_Q8_FULL512,
             w.WIDE_TYPES_Q8_VNNI),
            ("avx512", False, True, w.WIDE_TYPES_FULL512, w.WIDE_TYPES_Q8_FULL512,
             w.WIDE_TYPES_Q8_VNNI_ZEN5),
            ("avx2", True, False, w.WIDE_TYPES_AVX2, w.WIDE_TYPES_Q8_AVX2,
             w.WIDE_TYPES_Q8_AVXVNNI),
            ("avx2", False, True, w.WIDE_TYPES_AVX2, w.WIDE_TYPES_Q8_AVX2,
             w.WIDE_TYPES_Q8_AVXVNNI)):
        if name not in isas():
            continue
        monkeypatch.setattr(w, "splits_512", lambda s=split: s)
        monkeypatch.setattr(w, "amd_full_512", lambda z=zen5: z)
        MOD.set_isa(name)
        try:
            for gemm_backend in ("mkl", "onednn"):       # the float32 library plays no part
                monkeypatch.setenv("EXPERTFS_GEMM", gemm_backend)
                kernels.gemm.backend.cache_clear()
                for t in kernels.TYPES:
                    amx = w.WIDE_TYPES_AMX
                    want = amx[t] if t in amx and MOD.amx() else ex.get(t, 32)   # AMX's panel
                    assert kernels.max_tokens(t, 32) == want, (name, split, t.name)
                    want = (vnni[t] if w.q8_panel(MOD, t)
                            else q8.get(t, 32))        # the integer panel product takes over
                    assert kernels.max_tokens(t, 32, "q8") == want, (name, split, t.name)
        finally:
            MOD.set_isa("best")
            kernels.gemm.backend.cache_clear()
    MOD.set_isa("scalar")
    try:
        assert kernels.max_tokens(T.Q4_0, 32) == kernels.max_tokens(T.Q6_K, 32, "q8") == 32
    finally:
        MOD.set_isa("best")


_KZ_EXACT = (T.Q5_K, T.Q6_K)
_LOOKUP = (T.Q2_K, T.Q3_K, T.Q4_K, T.IQ4_XS)     # exact AVX-512 table-lookup kernels
_KZ_Q8 = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


@pytest.mark.skipif("avx512" not in isas(), reason="this CPU has no AVX-512")
@pytest.mark.parametrize("aq", ["off", "q8"])
@pytest.mark.parametrize("t", _K, ids=lambda t: t.name)
def test_avx512_k_quants_give_the_avx2_bits_for_any_batch(t, aq):
    """The K-quants' AVX-512 kernels (exact Q5_K and Q6_K: one row per vector; q8: 8 tokens
    per pass, Q4_K/Q5_K/Q6_K two rows per vector) give the AVX2 kernels' results bit for bit,
    per shape and token count (passes of each size, several passes); and on every ISA a
    token's result does not depend on the batch it comes in (exact Q2_K ... Q4_K and IQ4_XS
    take their own AVX-512 table-lookup kernels, whose results differ from the AVX2 ones in the
    last bits)."""
    info = MOD.info()
    assert (int(t) in info["avx512_k_exact_types"]) == (t in _KZ_EXACT)
    assert (int(t) in info["avx512_k_q8_types"]) == (t in _KZ_Q8)
    for k, cols in enumerate((256, 768)):
        rows = 29 + 8 * k                                     # odd
        raw = weight(t, rows, cols, int(t) * 5 + k)
        x = torch.randn(17, cols, generator=torch.Generator().manual_seed(k + 40))
        x[2, :32] = 0.0
        x[3] *= 1e-40                       # subnormal activations (SiLU of a very negative gate)
        got, alone = {}, {}
        for name in ("avx2", "avx512"):
            MOD.set_isa(name)
            try:
                got[name] = {nt: kernels.matvec(x[:nt], raw, t, (rows, cols), aq)
                             for nt in (1, 2, 4, 5, 8, 12, 17)}
                alone[name] = torch.cat([kernels.matvec(x[i:i + 1], raw, t, (rows, cols), aq)
                                         for i in range(17)])
            finally:
                MOD.set_isa("best")
        for nt, y in got["avx512"].items():
            for name in ("avx2", "avx512"):
                assert torch.equal(got[name][nt], alone[name][:nt]), (name, cols, nt)
            if not (t in _LOOKUP and aq == "off"):
                assert torch.equal(y, got["avx2"][nt]), (cols, nt)


@pytest.mark.skipif("avx512" not in isas() or not MOD.info().get("gfni"),
                    reason="this CPU has no AVX-512 with GFNI")
def test_q6_k_gives_the_same_bits_with_and_without_gfni():
    """Exact Q6_K's AVX-512 kernel decodes its bytes by GFNI where the CPU has it; the form
    for AVX-512 CPUs without GFNI (set_gfni(False)) gives the same bits, one row at a time and
    two (a pass's activations past 16 KiB), subnormal activations included."""
    for k, cols in enumerate((768, 4352)):
        rows = 29 + 8 * k                                     # odd
        raw = weight(T.Q6_K, rows, cols, 90 + k)
        x = torch.randn(17, cols, generator=torch.Generator().manual_seed(k + 60))
        x[3] *= 1e-40
        for nt in (1, 2, 5, 8, 17):
            with_gfni = kernels.matvec(x[:nt], raw, T.Q6_K, (rows, cols), "off")
            was = MOD.set_gfni(False)
            try:
                without = kernels.matvec(x[:nt], raw, T.Q6_K, (rows, cols), "off")
            finally:
                MOD.set_gfni(was)
            assert torch.equal(with_gfni, without), (cols, nt)


@pytest.mark.parametrize("t", [T.Q6_K, T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_many_small_matrices_in_one_call_equal_each_alone(t):
    """moe_down_rows over many small matrices (MLA's per-head products: 64 heads, whole
    matrices a chunk of the pool's work) gives each row of h by its own matrix what
    kernels.matvec gives it alone, bit for bit, at any thread count."""
    H, C = 64, 512
    g = torch.Generator().manual_seed(7)
    for R in (37, 256):
        mats = [weight(t, R, C, 100 + h) for h in range(H)]
        h = torch.randn(H, C, generator=g)
        alone = torch.cat([kernels.matvec(h[i:i + 1], mats[i], t, (R, C)) for i in range(H)])
        for threads in (1, 2):
            kernels.set_threads(threads)
            try:
                got = kernels.moe_down_rows(h, mats, t, R)
            finally:
                kernels.set_threads(0)
            assert torch.equal(got, alone), (R, threads)
