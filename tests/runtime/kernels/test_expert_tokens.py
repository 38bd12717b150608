"""``kernels.expert_tokens``: one routed expert over its share of a prompt's tokens in one
native call. Each pair's row equals what the prompt path computed before it, ``expert_ffn``
with the native kernels (``fused``) on the gathered tokens, weighted, bit for bit: on every
ISA, exact and q8, below and past each type's native token limit (where the product goes
through ``qgemm``), with a fused gate_up, with the SwiGLU clamp and with gpt-oss's
``swiglu_oai`` and bias rows. And the MoE layer's prompt path gives the same output with it
as without it.
"""

from __future__ import annotations

import pytest
import torch

from expertfs.formats.ggml import GGMLType as T
from expertfs.formats.moe_names import Role
from expertfs.runtime import kernels
from expertfs.runtime.experts.protocol import ExpertWeights
from expertfs.runtime.model import moe as moe_mod
from expertfs.runtime.model.ffn import expert_ffn
from expertfs.runtime.model.native_experts import native_expert_tokens
from support.qweights import f32_bias as bias, qweight as q
from support.native import MOD, NEEDS_NATIVE, isa, isas  # noqa: F401  (isa: a fixture)

pytestmark = NEEDS_NATIVE

D, FF = 512, 256


def expert(types: tuple[T, T, T], fused: bool = False, biased: bool = False,
           seed: int = 0) -> ExpertWeights:
    tg, tu, td = types
    parts = {Role.DOWN: q(td, D, FF, seed + 2)}
    if fused:
        parts[Role.GATE_UP] = q(tg, 2 * FF, D, seed)
    else:
        parts[Role.GATE], parts[Role.UP] = q(tg, FF, D, seed), q(tu, FF, D, seed + 1)
    if biased:
        parts.update({Role.GATE_BIAS: bias(FF, seed + 3), Role.UP_BIAS: bias(FF, seed + 4),
                      Role.DOWN_BIAS: bias(D, seed + 5)})
    return ExpertWeights(0, 0, parts)


def check(e: ExpertWeights, n: int, aq: str | None, limit: float = 0.0,
          alpha: float = 0.0) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(40, D, generator=g)
    tok = torch.randint(0, 40, (n,), generator=g)
    w = torch.rand(n, generator=g)
    out = torch.full((n, D), float("nan"))
    if not native_expert_tokens(x, tok, w, out, e, aq, limit, alpha):
        # only where a product is past its native limit and the portable kernels have no
        # qgemm (expert_ffn then dequantizes): nothing written
        assert MOD.isa() == "scalar" and torch.isnan(out).all()
        return
    want = expert_ffn(x.index_select(0, tok), e, True, aq, limit, alpha).float() * w[:, None]
    assert torch.equal(out, want)


TYPES = [(T.Q4_K, T.Q4_K, T.Q6_K), (T.IQ2_XXS, T.IQ2_XXS, T.IQ2_S), (T.IQ1_S, T.IQ1_S, T.IQ1_M),
         (T.Q8_0, T.Q4_0, T.Q5_0)]


@pytest.mark.parametrize("isa", isas(), indirect=True)
@pytest.mark.parametrize("types", TYPES, ids=lambda ts: "-".join(t.name for t in ts))
@pytest.mark.parametrize("aq", [None, "q8"])
def test_rows_equal_expert_ffn_on_both_sides_of_the_token_limit(isa, types, aq):
    e = expert(types)
    limits = {kernels.max_tokens(t, 32, aq) for t in types}
    for n in sorted({1, 2, 5, 9} | {m for lim in limits for m in (lim, lim + 1)}):
        check(e, n, aq)


@pytest.mark.parametrize("isa", isas(), indirect=True)
def test_fused_gate_up_and_the_clamp(isa):
    e = expert((T.Q4_K, T.Q4_K, T.Q6_K), fused=True)
    for n in (1, 7, 30):
        check(e, n, None)
        check(e, n, None, limit=0.05)


def test_swiglu_oai_with_bias_rows():
    e = expert((T.Q4_0, T.Q4_0, T.Q8_0), biased=True)   # gpt-oss's parts, as ggml bytes
    for n in (1, 6, 40):
        check(e, n, None, limit=7.0, alpha=1.702)
        check(e, n, "q8", limit=7.0, alpha=1.702)


def test_not_plain_ggml_bytes_is_not_applicable():
    parts = dict(expert((T.Q4_K, T.Q4_K, T.Q6_K)).parts)
    parts[Role.GATE] = torch.zeros(FF, D)                   # a dequantized (float) part
    out = torch.full((3, D), float("nan"))
    x = torch.randn(4, D)
    assert not native_expert_tokens(x, torch.tensor([0, 1, 3]), torch.ones(3), out,
                                    ExpertWeights(0, 0, parts))
    assert torch.isnan(out).all()


def test_batched_layer_is_the_same_with_and_without_the_one_call(monkeypatch):
    """``ExpertRunner._batched`` (a prompt's experts) gives the same output bits when each
    expert goes through ``expert_tokens`` as through ``expert_ffn``."""
    experts = {i: expert((T.Q4_K, T.Q4_K, T.Q6_K), seed=10 * i) for i in range(6)}

    class Provider:
        def get(self, layer, ids):
            return {i: experts[i] for i in ids}

        def release(self, layer):
            pass

    g = torch.Generator().manual_seed(0)
    T_, k = 37, 2
    x = torch.randn(T_, D, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(T_)])
    wts = torch.rand(T_, k, generator=g)
    counts = torch.bincount(ids.flatten(), minlength=6).tolist()
    used = [i for i in range(6) if counts[i]]

    def run() -> torch.Tensor:
        runner = moe_mod.ExpertRunner.__new__(moe_mod.ExpertRunner)
        runner.provider, runner.fused, runner.act_quant, runner._bounded = Provider(), True, \
            None, None
        runner._weights_each = lambda layer, es, then=None, arrival=False: \
            ((i, experts[i]) for i in es)
        return runner._batched(0, x, ids, wts, used, counts)

    fast = run()
    monkeypatch.setattr(moe_mod, "native_expert_tokens", lambda *a, **kw: False)
    assert torch.equal(fast, run())
