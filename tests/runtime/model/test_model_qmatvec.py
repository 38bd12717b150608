"""The fused one-token products from ggml bytes equal F.linear on the dequantized weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from expertfs.formats.dequant import dequantize
from expertfs.formats.ggml import type_size
from expertfs.formats.moe_names import Role
from expertfs.runtime.experts.protocol import ExpertWeights, QWeight
from expertfs.runtime.model import qmatvec
from expertfs.runtime.model.ffn import expert_ffn

_F16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_weight(t: T, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Valid bytes of a ``rows × cols`` weight: quantized floats, or random K-quant blocks with
    finite, small fp16 scales."""
    rng = np.random.default_rng(seed)
    if t in (T.Q4_0, T.Q8_0):
        return torch.from_numpy(quants.quantize(
            rng.standard_normal((rows, cols)).astype(np.float32), t).reshape(-1).copy())
    nb, ts = cols // 256, type_size(t)
    b = rng.integers(0, 256, (rows, nb, ts), dtype=np.uint8)
    for off in _F16_FIELDS[t]:
        b[..., off:off + 2] = (rng.standard_normal((rows, nb)) * 0.01).astype(
            np.float16).view(np.uint8).reshape(rows, nb, 2)
    return torch.from_numpy(b.reshape(-1))


@pytest.mark.parametrize("t", sorted(qmatvec.SUPPORTED, key=int))
def test_expression_equals_dequant_linear(t):
    rows, cols = 48, 512
    raw = random_weight(t, rows, cols, int(t))
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(1))
    ref = x @ dequantize(raw, t, (rows, cols)).T
    got = qmatvec.reference(raw, t, (rows, cols), x)
    tol = 1e-5 * float(ref.abs().max()) + 1e-5
    assert torch.allclose(got, ref, atol=tol, rtol=0)


@pytest.mark.parametrize("t", [T.Q4_K])
def test_compiled_product_equals_dequant_linear(t):
    rows, cols = 32, 256
    raw = random_weight(t, rows, cols, 9)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(2))
    ref = x @ dequantize(raw, t, (rows, cols)).T
    got = qmatvec.fused_matvec(x, raw, t, (rows, cols))
    if got is None:
        pytest.skip("torch.compile is not usable here")
    assert torch.allclose(got, ref, atol=1e-5 * float(ref.abs().max()) + 1e-5, rtol=0)


def test_fused_experts_equal_the_expert_loop():
    D, F_, n = 256, 64, 3
    experts = []
    for j in range(n):
        parts = {Role.GATE: QWeight(random_weight(T.Q8_0, F_, D, 10 + j), T.Q8_0, (F_, D)),
                 Role.UP: QWeight(random_weight(T.Q8_0, F_, D, 20 + j), T.Q8_0, (F_, D)),
                 Role.DOWN: QWeight(random_weight(T.Q4_0, D, F_, 30 + j), T.Q4_0, (D, F_))}
        experts.append(ExpertWeights(0, j, parts))
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(3))
    w = torch.tensor([0.5, 0.3, 0.2])
    ref = sum(w[j] * expert_ffn(x, e) for j, e in enumerate(experts))
    got = qmatvec.fused_experts(x, w, experts)
    if got is None:
        pytest.skip("torch.compile is not usable here")
    assert torch.allclose(got, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)


def test_not_applicable_cases_return_none():
    raw = random_weight(T.Q8_0, 32, 256, 1)
    assert qmatvec.fused_matvec(torch.randn(2, 256), raw, T.Q8_0, (32, 256)) is None
    assert qmatvec.fused_matvec(torch.randn(1, 256, dtype=torch.bfloat16), raw, T.Q8_0,
                                (32, 256)) is None
    assert qmatvec.fused_matvec(torch.randn(1, 256), raw, T.Q5_0, (32, 256)) is None


def test_engine_decode_with_fused_products_matches(tmp_path):
    """A decode step with the compiled expert products equals the eager path (a converted
    Mixtral with Q8_0 experts; compiled products of the quantized trunk are covered above)."""
    from hf_to_gguf import convert

    from expertfs.runtime.engine import Engine
    _, _, store = convert("mixtral", str(tmp_path), seed=41, expert_type=T.Q8_0,
                          num_hidden_layers=1)
    out = {}
    for fused in ("off", "on"):
        with Engine.open(store, provider="direct", fused=fused) as e:
            e.prefill([1, 2, 3])
            out[fused] = e.decode(4)
            assert e.runner.fused == (fused == "on")
    if not qmatvec.available():
        pytest.skip("torch.compile is not usable here")
    assert torch.allclose(out["on"], out["off"], atol=1e-4)
