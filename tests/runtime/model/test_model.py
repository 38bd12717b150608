"""The model runtime's parts: router semantics, RoPE scaling, batching, provider traffic,
lookahead, the dequantized-expert cache, the KV cache and config errors."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from hf_to_gguf import convert  # noqa: E402

from expertfs.errors import UnsupportedModelError, UsageError  # noqa: E402
from expertfs.runtime.engine import Engine, EngineOptions  # noqa: E402
from expertfs.runtime.experts.direct import DirectProvider  # noqa: E402
from expertfs.runtime.model import ModelConfig  # noqa: E402
from expertfs.runtime.model.config import (GATING_SIGMOID, GATING_SOFTMAX,  # noqa: E402
                                           GATING_SOFTMAX_WEIGHT)
from expertfs.runtime.model.router import Router, RouterWeights  # noqa: E402
from expertfs.store.reader import Store  # noqa: E402

TOKENS = [5, 100, 200, 37, 400, 12, 7, 300, 255, 1, 2, 3, 77, 500, 9, 64]


# --- router ----------------------------------------------------------------------------------

def _reference_route(x, W, b, gating, k, norm_w, scale, groups, groups_used):
    """build_moe_ffn for one token, written out with numpy and Python loops."""
    logits = W.astype(np.float64) @ x.astype(np.float64)
    if gating == GATING_SOFTMAX:
        p = np.exp(logits - logits.max())
        p /= p.sum()
    elif gating == GATING_SIGMOID:
        p = 1 / (1 + np.exp(-logits))
    else:
        p = logits
    sel = p + (b if b is not None else 0)
    if groups > 1:
        per = len(sel) // groups
        score = [np.sort(sel[g * per:(g + 1) * per])[-2:].sum() for g in range(groups)]
        keep = set(np.argsort(score)[::-1][:groups_used].tolist())
        sel = np.array([v if i // per in keep else -np.inf for i, v in enumerate(sel)])
    ids = np.argsort(-sel, kind="stable")[:k]
    w = p[ids]
    if gating == GATING_SOFTMAX_WEIGHT:
        w = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
    if norm_w:
        w = w / max(w.sum(), 6.103515625e-5)
    if scale:
        w = w * scale
    return ids, w


@pytest.mark.parametrize("gating,bias,groups,norm_w,scale", [
    (GATING_SOFTMAX, False, 1, True, 0.0),            # qwen3moe, Mixtral
    (GATING_SIGMOID, True, 1, True, 2.5),             # glm4moe
    (GATING_SIGMOID, True, 4, True, 2.5),             # DeepSeek-V3 style groups
    (GATING_SOFTMAX, False, 1, False, 16.0),          # DeepSeek-V2 style
    (GATING_SOFTMAX_WEIGHT, False, 1, False, 0.0),    # gpt-oss
])
def test_router_matches_build_moe_ffn(gating, bias, groups, norm_w, scale):
    g = torch.Generator().manual_seed(7)
    E, D, k, Tn = 16, 32, 4, 9
    W = torch.randn(E, D, generator=g)
    b = torch.randn(E, generator=g) * 0.5 if bias else None
    x = torch.randn(Tn, D, generator=g)
    cfg = ModelConfig(arch="x", n_layers=1, n_nextn=0, n_embd=D, n_head=1, n_head_kv=1,
                      head_dim=D, v_head_dim=D, n_vocab=8, n_ff=8, n_ff_exp=8, n_experts=E,
                      n_expert_used=k, n_expert_shared=0, n_dense_lead=0, rms_eps=1e-6,
                      rope="neox", n_rot=D, rope_base=1e4, gating=gating, norm_w=norm_w,
                      w_scale=scale, n_group=groups, n_group_used=2 if groups > 1 else 1)
    ids, wts, _ = Router(cfg)(x, RouterWeights(W, b))
    for t in range(Tn):
        rid, rw = _reference_route(x[t].numpy(), W.numpy(), None if b is None else b.numpy(),
                                   gating, k, norm_w, scale, groups, 2 if groups > 1 else 1)
        assert ids[t].tolist() == rid.tolist()
        np.testing.assert_allclose(wts[t].numpy(), rw, rtol=1e-5, atol=1e-6)
    # the lookahead's guess: the same choice best first, k + 2 deep, one token (native) or many
    r = Router(cfg)
    for t in range(Tn):
        top = r.top(x[t:t + 1], RouterWeights(W, b), k + 2)
        assert top.shape == (1, k + 2) and top[0, :k].tolist() == ids[t].tolist()
    assert r.top(x, RouterWeights(W, b), k)[:, :k].tolist() == ids.tolist()


def test_bias_selects_but_does_not_weigh():
    cfg = ModelConfig(arch="x", n_layers=1, n_nextn=0, n_embd=4, n_head=1, n_head_kv=1,
                      head_dim=4, v_head_dim=4, n_vocab=8, n_ff=8, n_ff_exp=8, n_experts=4,
                      n_expert_used=1, n_expert_shared=0, n_dense_lead=0, rms_eps=1e-6,
                      rope="neox", n_rot=4, rope_base=1e4, gating=GATING_SIGMOID, norm_w=False)
    W = torch.eye(4)
    x = torch.tensor([[3.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    ids, wts, _ = Router(cfg)(x, RouterWeights(W, bias))
    assert ids.tolist() == [[3]]                       # chosen for its bias
    assert wts.item() == pytest.approx(0.5)            # weighed by sigmoid(0), unbiased


# --- whole-model behaviour ---------------------------------------------------------------------

class SpyProvider:
    """DirectProvider that records every call."""

    def __init__(self, store):
        self.inner = DirectProvider(store)
        self.stats = self.inner.stats
        self.gets: list[tuple[int, list[int]]] = []
        self.prefetches: list[tuple[int, list[int]]] = []
        self.releases: list[int] = []

    def get(self, layer, experts):
        self.gets.append((layer, list(experts)))
        return self.inner.get(layer, experts)

    def prefetch(self, layer, experts, source="gate"):
        self.prefetches.append((layer, list(experts)))

    def release(self, layer):
        self.releases.append(layer)
        self.inner.release(layer)

    def close(self):
        self.inner.close()


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm")
    model, gguf, store = convert("glm4moe", str(d), seed=11, num_hidden_layers=4)
    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0].numpy()
    return store, ref


def _engine(store, **opts):
    st = Store.open(store)
    spy = SpyProvider(st)
    return st, spy, Engine(st, spy, EngineOptions(**opts))


def test_each_expert_fetched_once_per_batch_and_layer(glm):
    store, ref = glm
    st, spy, eng = _engine(store, prefill_batch=len(TOKENS), prefill_prefetch=False)
    try:
        got = eng.logits(TOKENS).numpy()
        cfg = eng.config
    finally:
        eng.close()
        st.close()
    assert np.abs(got - ref).max() < 1e-4
    moe_layers = [i for i in range(cfg.n_layers) if i >= cfg.n_dense_lead]
    assert [g[0] for g in spy.gets] == moe_layers          # one get per MoE layer
    for _, ids in spy.gets:
        assert len(ids) == len(set(ids)) and len(ids) <= cfg.n_experts
    assert spy.releases == moe_layers
    assert spy.prefetches == []                            # lookahead off by default


def test_prompt_batch_prefetches_the_next_layers_predicted_experts(glm):
    """With ``prefill_prefetch`` a prompt batch hands the next MoE layer's gate predictions
    (the batch's union, most wanted first) to the provider after its own reads; decode steps
    do not (the lookahead is off); results are unchanged."""
    store, ref = glm
    st, spy, eng = _engine(store, prefill_batch=len(TOKENS), prefill_prefetch=True)
    try:
        got = eng.logits(TOKENS).numpy()
        eng.decode(3)
        cfg = eng.config
    finally:
        eng.close()
        st.close()
    assert np.abs(got - ref).max() < 1e-4
    moe_layers = [i for i in range(cfg.n_layers) if i >= cfg.n_dense_lead]
    # every MoE layer but a first one, predicted from the layer before it; the batch only
    assert [la for la, _ in spy.prefetches] == [la for la in moe_layers if la > 0]
    for la, ids in spy.prefetches:
        assert ids and len(ids) == len(set(ids)) and len(ids) <= cfg.n_experts


def test_lookahead_prefetches_next_layer_and_scores(glm):
    store, ref = glm
    st, spy, eng = _engine(store, lookahead=True, lookahead_margin=1, prefill_batch=4)
    try:
        got = eng.logits(TOKENS).numpy()
        for t in (1, 2, 3):
            eng.decode(t)
        la = eng.stats()["lookahead"]
        cfg = eng.config
    finally:
        eng.close()
        st.close()
    assert np.abs(got - ref).max() < 1e-4                   # prediction never changes results
    assert spy.prefetches and all(layer >= cfg.n_dense_lead + 1 or layer == cfg.n_dense_lead
                                  for layer, _ in spy.prefetches)
    decode_pf = spy.prefetches[-(cfg.n_layers - cfg.n_dense_lead):]
    assert all(len(ids) == cfg.n_expert_used + 1 for _, ids in decode_pf)
    assert 0 < la["predicted"] and 0 <= la["coverage"] <= 1 and 0 <= la["waste"] <= 1
    assert la["hits"] <= min(la["predicted"], la["used"])


def test_dequant_cache_hits_and_same_logits(tmp_path):
    _, _, store = convert("qwen3moe", str(tmp_path), seed=12, expert_type=T.Q4_0)
    with Engine.open(store, provider="direct", fused="off") as a:
        ref = a.logits(TOKENS).numpy()
    with Engine.open(store, provider="direct", dq_cache=64 << 20, fused="off") as b:
        got1 = b.logits(TOKENS).numpy()
        fetched = b.runner.stats.fetches
        got2 = b.logits(TOKENS).numpy()
        s = b.stats()
    np.testing.assert_allclose(got1, ref, atol=1e-4)
    np.testing.assert_array_equal(got1, got2)
    assert s["moe"]["fetches"] == fetched                  # second pass: no provider traffic
    assert s["dq_cache"]["hits"] > 0 and s["dq_cache"]["used"] <= 64 << 20


def test_dequant_cache_is_off_where_the_native_kernels_take_every_expert_type(tmp_path, caplog):
    """On the CPU the native products from the blocks beat dequantized floats: the cache is
    not used, and says so."""
    from expertfs.runtime import kernels
    _, _, store = convert("qwen3moe", str(tmp_path), seed=12, expert_type=T.Q4_0)
    with caplog.at_level("WARNING"), Engine.open(store, provider="direct",
                                                 dq_cache=64 << 20) as e:
        e.logits(TOKENS)
        s = e.stats()["dq_cache"]
    if kernels.available():
        assert s["budget"] == 0 and s["hits"] == 0 and "--dq-cache not used" in caplog.text
    else:
        assert s["budget"] == 64 << 20


def test_dequant_cache_budget_evicts(tmp_path):
    _, _, store = convert("qwen3moe", str(tmp_path), seed=13)
    one = 3 * 32 * 64 * 4                                   # one float32 expert
    with Engine.open(store, provider="direct", dq_cache=3 * one, fused="off") as e:
        e.logits(TOKENS)
        s = e.stats()["dq_cache"]
    assert s["experts"] <= 3 and s["used"] <= 3 * one and s["evictions"] > 0


def test_cache_zeros_are_zero_mappings_of_their_own():
    """On the CPU a cache tensor is an anonymous mapping (freed to the system with it, its
    pages the kernel's zero pages until written); elsewhere ``torch.zeros``."""
    from expertfs.runtime.model.attention import cache_zeros
    for shape, dtype in (((2, 3, 5), torch.float32), ((4, 1024, 576), torch.bfloat16),
                         ((0, 8, 8), torch.float32)):
        t = cache_zeros(shape, dtype, torch.device("cpu"))
        assert t.shape == shape and t.dtype == dtype and not t.any()
        if t.numel():
            assert t.data_ptr() % 4096 == 0
            t[-1, -1, -1] = 3
            assert float(t.sum()) == 3


def test_kv_cache_grows_and_refuses_overflow(tmp_path):
    model, _, store = convert("mixtral", str(tmp_path), seed=14)
    toks = [int(t) for t in torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].numpy()
    with Engine.open(store, provider="direct", n_ctx=300, prefill_batch=128) as e:
        got = e.logits(toks).numpy()
        cache = e.model.cache
        assert cache.capacity == 300
        for t in cache.k + cache.v:           # grown into mappings of their own (cache_zeros):
            assert t.data_ptr() % 4096 == 0
        with pytest.raises(UsageError, match="exceeds n_ctx"):
            e.decode(1)
        e.reset(299)
        e.decode(toks[-1])                                 # after rewinding, room again
    assert np.abs(got - ref).max() < 2e-4


@pytest.mark.parametrize("kind,scaling", [
    ("qwen3moe", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    ("mixtral", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    ("qwen3moe", {"rope_type": "linear", "factor": 2.0}),
    ("mixtral", {"rope_type": "linear", "factor": 2.0}),
    ("deepseek2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                   "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
    # Kimi-K2's: beta_fast = beta_slow = 1 (a one-dimension ramp), which the file carries and
    # llama.cpp 0.3.36's deepseek2 does not read (it keeps its 32 / 1): transformers is the
    # reference here
    ("deepseek2", {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                   "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0,
                   "rope_theta": 50000.0}),
])
def test_rope_scaling_matches_transformers(tmp_path, kind, scaling):
    model, _, store = convert(kind, str(tmp_path), seed=15, rope_scaling=scaling,
                              max_position_embeddings=128)
    toks = list(range(3, 300, 11))
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].numpy()
    with Engine.open(store, provider="direct", fused="off") as e:
        got = e.logits(toks).numpy()
    assert np.abs(got - ref).max() < 1e-4


def test_unsupported_architecture_is_a_typed_error():
    kv = {"general.architecture": "mamba", "mamba.block_count": 2}
    with pytest.raises(UnsupportedModelError, match="not supported"):
        ModelConfig.from_gguf(kv)


def test_dense_model_is_refused():
    kv = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 2,
          "qwen3moe.embedding_length": 64, "qwen3moe.attention.head_count": 4}
    with pytest.raises(UnsupportedModelError, match="no routed experts"):
        ModelConfig.from_gguf(kv)


def test_one_expert_groups_are_refused(tmp_path):
    """Group-limited routing scores each group by its two best experts: a GGUF whose groups hold
    one expert each is a typed error, not a torch error in the first token's routing."""
    from expertfs.store.reader import Store
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    cfg = SynthConfig.tiny("deepseek2")
    synthesize(cfg, str(tmp_path / "d.gguf"))
    repack([str(tmp_path / "d.gguf")], str(tmp_path / "d.efs"))
    with Store.open(str(tmp_path / "d.efs")) as st:
        kv = dict(st.gguf_kv())
    assert ModelConfig.from_gguf(kv).n_group == cfg.expert_group_count
    kv["deepseek2.expert_group_count"] = cfg.n_experts
    with pytest.raises(UnsupportedModelError, match="two best"):
        ModelConfig.from_gguf(kv, path="model.gguf")


def test_synth_archs_run(tmp_path):
    """Synth's qwen3moe, glm4moe (+NextN), llama and deepseek2 (MLA, groups) GGUFs in mixed
    K-quants load and run."""
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    for arch in ("qwen3moe", "glm4moe", "llama", "deepseek2"):
        cfg = SynthConfig.tiny(arch).replace(quant="q4_k_m")
        g, s = tmp_path / f"{arch}.gguf", tmp_path / f"{arch}.efs"
        synthesize(cfg, str(g))
        repack([str(g)], str(s))
        with Engine.open(str(s), provider="direct", trunk="quant", fused="off") as e:
            lg = e.logits([1, 2, 3, 4])
            assert lg.shape == (4, cfg.n_vocab) and torch.isfinite(lg).all()
            assert len(e.trunk.nextn) == cfg.n_nextn
