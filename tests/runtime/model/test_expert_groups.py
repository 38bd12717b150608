"""Issue 17 item 7: a get's experts dequantized per role in one call (``expert_groups``), the
device path's few launches a layer instead of some 25 per matrix. Each expert's float weights are
the bits it gets dequantized alone (every type, fused gate_up, bias parts), so its products are
too; the MoE layer asks for one dequantization per role and group; a tiered run (experts landing
in groups of any size) gives a resident run's logits bit for bit, and the ungrouped path's."""

from __future__ import annotations

import pytest
import torch

from expertfs.formats.dequant import dequantize
from expertfs.formats.ggml import GGMLType as T
from expertfs.formats.moe_names import Role
from expertfs.runtime.engine import Engine
from expertfs.runtime.experts.protocol import ExpertWeights
from expertfs.runtime.model import expert_groups
from expertfs.runtime.model.dqcache import DequantCache
from expertfs.runtime.model.expert_groups import as_computed, dequant_group, group_rows, groupable
from expertfs.runtime.model.ffn import FloatExpert, expert_ffn, to_float_expert
from expertfs.runtime.model.moe import ExpertRunner
from support.qweights import f32_bias as bias, qweight as q
from support.cache_store import tiny_store
from support.landing import LandingProvider

D, FF = 256, 256


def expert(e: int, tg: T, td: T, fused: bool = False, biased: bool = False) -> ExpertWeights:
    s = 10 * e
    parts = {Role.DOWN: q(td, D, FF, s)}
    if fused:
        parts[Role.GATE_UP] = q(tg, 2 * FF, D, s + 1)
    else:
        parts[Role.GATE], parts[Role.UP] = q(tg, FF, D, s + 1), q(tg, FF, D, s + 2)
    if biased:
        parts.update({Role.GATE_BIAS: bias(FF, s + 3), Role.UP_BIAS: bias(FF, s + 4),
                      Role.DOWN_BIAS: bias(D, s + 5)})
    return ExpertWeights(0, e, parts)


CASES = [(T.Q4_K, T.Q6_K, False, False), (T.IQ2_XXS, T.IQ3_S, False, False),
         (T.IQ1_S, T.IQ1_M, False, False), (T.Q8_0, T.Q4_0, True, False),
         (T.MXFP4, T.MXFP4, True, True), (T.F16, T.BF16, False, True)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32),
        b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32))


@pytest.mark.parametrize("tg,td,fused,biased", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_expert_of_a_group_is_its_own_dequantization(tg, td, fused, biased, dtype):
    ws = [expert(e, tg, td, fused, biased) for e in range(3)]
    assert groupable(ws)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    for own in (False, True):
        fs = dequant_group(ws, dtype, own=own)
        for w, f in zip(ws, fs):
            alone = to_float_expert(w, dtype)
            assert f.parts.keys() == alone.parts.keys() and f.nbytes == alone.nbytes
            for role, t in alone.parts.items():
                assert same_bits(f.parts[role], t), (role, own)
                assert same_bits(t, dequantize(w.parts[role].raw, w.parts[role].ggml_type,
                                               w.parts[role].shape, dtype=dtype))
            # its products are those of the expert dequantized alone
            assert same_bits(expert_ffn(x, f), expert_ffn(x, alone))
        bases = {f.parts[Role.DOWN].untyped_storage().data_ptr() for f in fs}
        assert len(bases) == (3 if own else 1)          # own: each expert its own storage


def test_only_one_layers_kind_of_experts_is_groupable():
    a, b = expert(0, T.Q4_K, T.Q6_K), expert(1, T.Q4_K, T.Q6_K)
    assert groupable([a, b]) and groupable([a])
    assert not groupable([])
    assert not groupable([a, expert(2, T.Q5_K, T.Q6_K)])                 # another type
    assert not groupable([a, expert(2, T.Q4_K, T.Q6_K, fused=True)])     # other parts
    other = ExpertWeights(0, 3, {**a.parts, Role.DOWN: q(T.Q6_K, D, 2 * FF, 3)})
    assert not groupable([a, other])                                     # another shape
    assert not groupable([a, to_float_expert(b, torch.float32)])         # already float


def test_as_computed_groups_and_fills_the_dequant_cache(monkeypatch):
    calls = []
    real = expert_groups.dequantize
    monkeypatch.setattr(expert_groups, "dequantize",
                        lambda raw, t, shape, dtype: calls.append(shape) or real(raw, t, shape,
                                                                                dtype=dtype))
    got = {e: expert(e, T.Q4_K, T.Q6_K) for e in range(5)}
    out = as_computed(3, got, torch.float32, DequantCache(0), grouped=True, group_max=2)
    assert list(out) == list(got) and all(isinstance(f, FloatExpert) for f in out.values())
    # groups of 2, 2 and 1: gate and up (one type and shape) in one call, down in another
    assert calls == [(4 * FF, D), (2 * D, FF)] * 2 + [(2 * FF, D), (D, FF)]
    # not grouped: the weights as they are; with the dequant cache: float experts, cached
    assert as_computed(3, got, torch.float32, DequantCache(0), False, 2) == got
    dq = DequantCache(1 << 30)
    out = as_computed(3, got, torch.float32, dq, grouped=True, group_max=8)
    assert len(dq) == 5 and all(dq.get(3, e) is out[e] for e in got)
    assert len({f.parts[Role.UP].untyped_storage().data_ptr() for f in out.values()}) == 5
    mixed = {0: got[0], 1: expert(1, T.Q5_K, T.Q6_K)}                     # not one kind:
    assert as_computed(3, mixed, torch.float32, DequantCache(0), True, 8) == mixed  # as they are


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tiny_store(tmp_path_factory.mktemp("groups"))


PROMPT, TOKS = [3, 17, 40, 2, 9, 250, 31], [5, 99, 7, 64, 12, 31, 8, 150]


def _decode(e, grouped):
    e.runner.grouped = grouped
    out = [e.prefill(PROMPT)]
    out += [e.decode(t) for t in TOKS]
    return torch.stack(out)


@pytest.fixture(scope="module")
def resident(store):
    """The resident run's logits on the CPU (each expert dequantized on its own), and the
    store's expert slot and k, which size the tiered runs' small tiers."""
    with Engine.open(store, provider="direct", fused="off") as e:
        assert not e.runner.grouped                     # CPU: the native path's, chunked
        want = _decode(e, False)
        slot = max(e.store.extent(la, 0).length for la in e.store.layers)
        return want, slot, e.config.n_expert_used


def _tiered(store, resident, backend=None, **kw):
    """A run with RAM and VRAM tiers of 6 and 2 layers' experts: reads land in groups."""
    _, slot, k = resident
    opts = {"warm_start": False, "record_usage": False, **({"backend": backend} if backend else {})}
    return Engine.open(store, provider="tiered", ram_bytes=6 * k * slot, vram_bytes=2 * k * slot,
                       provider_options=opts, **kw)


def test_tiered_grouped_decode_equals_a_resident_run(store, resident, monkeypatch):
    plain, _, k = resident
    with Engine.open(store, provider="direct", fused="off") as e:
        want = _decode(e, True)
    assert torch.allclose(want, plain, rtol=1e-5, atol=1e-5)
    sizes = []
    real = expert_groups.dequant_group
    monkeypatch.setattr(expert_groups, "dequant_group",
                        lambda ws, *a, **kw: sizes.append(len(ws)) or real(ws, *a, **kw))
    with _tiered(store, resident, "buffered", fused="off") as e:
        assert e.runner.group_max == k
        got = _decode(e, True)
        st = e.provider.stats
        assert st.hits.get("vram", 0) > 0 and st.misses > 0
    assert torch.equal(got, want)
    assert max(sizes) > 1 and max(sizes) <= k          # groups of several experts, at most k


@pytest.mark.parametrize("tg,td,fused,biased", CASES)
@pytest.mark.parametrize("limit,alpha", [(0.0, 0.0), (0.5, 0.0), (7.0, 1.702)])
def test_group_rows_are_each_experts_output(tg, td, fused, biased, limit, alpha):
    ws = [expert(e, tg, td, fused, biased) for e in range(3)]
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(3))
    rows = group_rows(x, ws, limit, alpha)
    assert rows.shape == (3, D) and rows.dtype == torch.float32
    for j, w in enumerate(ws):
        want = expert_ffn(x, to_float_expert(w, torch.float32), limit=limit, alpha=alpha)[0]
        assert torch.allclose(rows[j], want, rtol=1e-4, atol=1e-5 * want.abs().max())
    lo = group_rows(x.bfloat16(), ws, limit, alpha)            # the compute dtype of CUDA
    assert lo.dtype == torch.float32
    assert torch.allclose(lo, rows, rtol=0.05, atol=0.05 * rows.abs().max())


def test_device_step_computes_each_group_as_it_lands():
    """The decode step's device path (``_overlapped`` without the native kernels): the
    resident experts' rows and the shared expert before the first wait, then each landed
    group's; the weighted sum over the rows in routing order."""
    weights = {e: expert(e, T.Q4_K, T.Q6_K) for e in range(6)}
    prov = LandingProvider(weights, ready=[4, 1], landing=[5, 0])
    r = ExpertRunner(prov, router=None, dtype=torch.float32, grouped=True, group_products=True)
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(5))
    wts = torch.tensor([0.4, 0.3, 0.2, 0.1])
    experts = [0, 1, 4, 5]

    def shared(x):
        prov.log.append("shared")
        return x * 0
    out, got, sh = r._overlapped(7, x, wts, experts, shared, lambda: prov.log.append("then"))
    assert prov.log == ["begin", "then", "shared", "land 5", "land 0"]
    assert set(got) == set(experts) and r.stats.overlapped == 1 and sh is not None
    want = sum(float(wts[j]) * expert_ffn(x, to_float_expert(weights[e], torch.float32))
               for j, e in enumerate(experts))
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-4 * want.abs().max())
    # every expert resident: computed here too (one group), not left to the caller
    prov = LandingProvider(weights, ready=experts, landing=[])
    r = ExpertRunner(prov, router=None, dtype=torch.float32, grouped=True, group_products=True)
    out2, _, _ = r._overlapped(7, x, wts, experts, None, lambda: None)
    assert torch.allclose(out2, want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_tiered_decode_with_group_products_matches_a_resident_run(store, resident):
    want = resident[0]
    with _tiered(store, resident, "buffered", fused="off") as e:
        e.runner.group_products = True
        got = _decode(e, True)
        assert e.runner.stats.fetches > 0
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _on(w: ExpertWeights, device: str) -> ExpertWeights:
    return ExpertWeights(w.layer, w.expert, {r: type(q)(q.raw.to(device), q.ggml_type, q.shape)
                                              for r, q in w.parts.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("tg,td,fused,biased", CASES)
def test_group_rows_on_cuda_equal_the_cpus(tg, td, fused, biased):
    """bench/gpu_check.sh step 2: the device path's group products on CUDA, float32 to the
    products' rounding and bfloat16 (the CUDA compute dtype) to its precision."""
    ws = [expert(e, tg, td, fused, biased) for e in range(3)]
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(3))
    want = group_rows(x, ws)
    on = [_on(w, "cuda") for w in ws]
    got = group_rows(x.cuda(), on).cpu()
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * want.abs().max())
    lo = group_rows(x.cuda().bfloat16(), on).cpu()
    assert torch.allclose(lo, want, rtol=0.05, atol=0.05 * want.abs().max())
    fs = dequant_group(on, torch.bfloat16)
    for w, f in zip(ws, fs):
        alone = to_float_expert(_on(w, "cuda"), torch.bfloat16)
        assert all(torch.equal(f.parts[r], t) for r, t in alone.parts.items())


@pytest.mark.gpu
def test_tiered_cuda_decode_with_groups_matches_the_cpu(store, resident):
    """A CUDA run with a small VRAM tier (grouped dequantization and group products, its
    defaults there) against the CPU's resident logits, float32."""
    want, _, k = resident
    with _tiered(store, resident, device="cuda", dtype=torch.float32) as e:
        assert e.runner.grouped and e.runner.group_products and e.runner.group_max == k
        got = _decode(e, True).cpu()
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * want.abs().max())
