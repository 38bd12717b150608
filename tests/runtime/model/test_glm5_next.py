"""glm5-next (GLM-5.3-Flash) against transformers' Glm5Next text model, through llama.cpp's converter.

A tiny seeded transformers model with every feature (mHC streams, a dense leading block and MoE
blocks with a shared expert and a biased sigmoid router, KDA and nope-only MLA layers, a full
and a shared indexer layer with k-pool compression and the always-selected tail, a prompt three
times ``index_topk`` so the sparse selection runs, swiglu clamps that bite, a NextN block with
its own experts) is written as a flat GLM-5.3-Flash checkpoint (the names transformers'
conversion mapping reads), converted to GGUF F32 by llama.cpp's own ``convert_hf_to_gguf.py``,
repacked and run by the engine. The shared layer directly follows its full layer: transformers
hands a selection on only from the layer just before (llama.cpp, and the runtime, keep it across
KDA layers too). The seed gives every indexer and router top-k a clear gap (checked).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from llamacpp_convert import ConverterUnavailable, convert, tiny_bpe_tokenizer

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.experts.direct import DirectProvider
from expertfs.store.reader import Store
from expertfs.store.repack import repack

TOL = 1e-3
SEED = 1
N_LAYERS = 4
TOP_K, KPOOL = 8, 4
VOCAB = 320
TOKENS = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(7)).tolist()
DEVICE = os.environ.get("EXPERTFS_TEST_DEVICE", "cpu")
GAP = 1e-4
LAYER_TYPES = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
               "indexed_attention"]
INDEXER_TYPES = ["full", "full", "shared", "full", "full"]


def _config(n_layers: int = N_LAYERS):
    from glm5next_ref import tiny_config
    return tiny_config(n_layers, vocab_size=VOCAB, layer_types=LAYER_TYPES[:n_layers],
                       indexer_types=INDEXER_TYPES[:n_layers],
                       mlp_layer_types=(["dense"] + ["sparse"] * 4)[:n_layers],
                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                       routed_scaling_factor=2.5, index_topk=TOP_K, index_kpool=KPOOL, index_n_heads=4,
                       swiglu_limit=1.5, linear_lower_bound=-5.0, pad_token_id=0)


def _model(seed: int, n_layers: int = N_LAYERS):
    from transformers.models.glm5_next import modeling_glm5_next as M

    from glm5next_ref import seed_
    cfg = _config(n_layers)
    text = M.Glm5NextTextModel(cfg)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    seed_(text, seed)
    seed_(head, seed + 1, std=0.1)
    with torch.no_grad():
        for layer in text.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05,
                                                               generator=torch.Generator()
                                                               .manual_seed(seed + 2))
    return text, head


def _ref(text, head, tokens) -> np.ndarray:
    with torch.no_grad():
        h = text(torch.tensor([tokens]), use_cache=False).last_hidden_state
        return head(h)[0].numpy()


def _checkpoint(text, head, first: int = 0, nextn: bool = False) -> dict[str, torch.Tensor]:
    """The model's tensors under the flat checkpoint's names (transformers' conversion mapping
    reversed): per-expert matrices, q/k/v convs, hc_* and the KDA gate names."""
    out = {}
    for k, v in text.state_dict().items():
        v = v.detach().clone().contiguous()
        if not k.startswith("layers."):
            out["model." + k] = v
            continue
        i = int(k.split(".")[1])
        if i < first:
            continue
        if nextn and "_hc." in k:
            continue
        for a, b in (("forget_gate.", ""), ("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_")):
            k = k.replace(a, b)
        if k.endswith("self_attn.conv1d.weight"):
            for n, part in zip("qkv", v.chunk(3, dim=0)):
                out["model." + k.replace("conv1d", f"{n}_conv1d")] = part.contiguous()
        elif k.endswith("mlp.experts.gate_up_proj"):
            base = "model." + k[:-len("gate_up_proj")]
            for e, gu in enumerate(v):
                g, u = gu.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"] = g.contiguous()
                out[f"{base}{e}.up_proj.weight"] = u.contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            base = "model." + k[:-len("down_proj")]
            for e, d in enumerate(v):
                out[f"{base}{e}.down_proj.weight"] = d.contiguous()
        else:
            out["model." + k] = v
    if head is not None:
        out["lm_head.weight"] = head.weight.detach().clone()
    return out


def _hf_config(cfg) -> dict:
    d = cfg.to_dict()
    d.update(architectures=["Glm5NextForConditionalGeneration"], model_type="glm5_next",
             linear_attn_config=dict(num_heads=cfg.linear_num_heads, head_dim=cfg.linear_head_dim,
                                     short_conv_kernel_size=cfg.linear_conv_kernel_dim,
                                     gate_lower_bound=cfg.linear_lower_bound),
             mla_use_nope=True, first_k_dense_replace=1, num_nextn_predict_layers=1,
             num_experts=cfg.n_routed_experts, torch_dtype="float32")
    return d


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("glm5_next"), "f32")


@pytest.fixture(scope="module")
def built_f16(tmp_path_factory):
    """The same model with every weight rounded to float16 (in transformers too), converted to
    F16, which is then lossless: the experts run on the native F16 kernels."""
    return _build(tmp_path_factory.mktemp("glm5_next_f16"), "f16")


def _build(d, outtype: str):
    from safetensors.torch import save_file
    text, head = _model(SEED)
    if outtype == "f16":
        with torch.no_grad():
            for v in (*text.state_dict().values(), *head.state_dict().values()):
                if v.is_floating_point():
                    v.copy_(v.half().float())
    hf = d / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(_hf_config(text.config)))
    tiny_bpe_tokenizer(hf, VOCAB)
    t5, _ = _model(SEED + 100, N_LAYERS + 1)
    nx = {k: v for k, v in _checkpoint(t5, None, N_LAYERS, nextn=True).items()
          if k.startswith(f"model.layers.{N_LAYERS}.")}
    g = torch.Generator().manual_seed(SEED + 200)
    D, p = text.config.hidden_size, f"model.layers.{N_LAYERS}."
    nx[p + "eh_proj.weight"] = torch.randn(D, 2 * D, generator=g) * 0.05
    for n in ("enorm", "hnorm", "shared_head.norm"):
        nx[p + n + ".weight"] = 1.0 + 0.2 * torch.randn(D, generator=g)
    if outtype == "f16":
        nx = {k: v.half().float() for k, v in nx.items()}
    save_file({**_checkpoint(text, head), **nx}, hf / "model.safetensors",
              metadata={"format": "pt"})
    try:
        gguf = convert(hf, d / f"model-{outtype.upper()}.gguf", outtype=outtype)
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp's converter is unavailable: {e}")
    store = str(d / "model.efs")
    repack([str(gguf)], store, force=True)
    return text, head, store, _ref(text, head, TOKENS)


def _engine(store: str, **opts) -> Engine:
    opts = {"device": DEVICE, "dtype": "float32", "fused": "off", **opts}
    st = Store.open(store)
    return Engine(st, DirectProvider(st, opts["device"]), EngineOptions(**opts))


def _ours(store: str, tokens=TOKENS, **opts) -> np.ndarray:
    eng = _engine(store, **opts)
    try:
        return eng.logits(tokens).numpy()
    finally:
        eng.close()
        eng.store.close()


def _gaps(text, tokens) -> tuple[float, float]:
    """The smallest gap at the top-k boundary of every indexer row that sees more than
    ``index_topk // kpool`` pools, and of every router row (transformers' own modules)."""
    idx_gaps, route_gaps = [], []

    def on_indexer(mod, args, kwargs):
        x, qr = kwargs["hidden_states"], kwargs["q_resid"]
        S, P = x.shape[1], mod.index_kpool
        q = mod.wq_b(qr)[0].view(S, mod.n_heads, mod.head_dim)
        k = mod.k_norm(mod.wk(x))[0]
        gate = torch.nn.functional.linear(x, mod.index_kpool_compress_gate)[0]
        n = S // P
        pk = (torch.softmax(gate[:n * P].view(n, P, -1) + mod.index_kpool_compress_ape, 1)
              * k[:n * P].view(n, P, -1)).sum(1)
        w = mod.weights_proj(x)[0]
        score = torch.einsum("th,thp->tp", w, torch.einsum("thd,pd->thp", q, pk).relu())
        top = mod.index_topk // P
        for t in range(S):
            vis = (t + 1) // P
            if vis > top:
                v = score[t, :vis].sort(descending=True).values
                idx_gaps.append(float(v[top - 1] - v[top]))

    def on_router(mod, args):
        x = args[0].reshape(-1, mod.hidden_dim).float()
        sel = torch.sigmoid(x @ mod.weight.T) + mod.e_score_correction_bias
        v = sel.sort(-1, descending=True).values
        route_gaps.append(float((v[:, mod.top_k - 1] - v[:, mod.top_k]).min()))

    hooks = [l.self_attn.indexer.register_forward_pre_hook(on_indexer, with_kwargs=True)
             for l in text.layers if getattr(l.self_attn, "indexer", None) is not None]
    hooks += [l.mlp.gate.register_forward_pre_hook(on_router)
              for l in text.layers if hasattr(l.mlp, "gate")]
    try:
        with torch.no_grad():
            text(torch.tensor([tokens]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return min(idx_gaps), min(route_gaps)


def test_the_seed_gives_every_top_k_a_clear_gap(built):
    idx_gap, route_gap = _gaps(built[0], TOKENS)
    assert idx_gap > GAP and route_gap > GAP


def test_the_sparse_selection_changes_the_logits(built):
    """Past index_topk positions a dense MLA would give other logits (exact below it)."""
    text, head, _, ref = built
    mods = [l.self_attn.indexer for l in text.layers
            if getattr(l.self_attn, "indexer", None) is not None]
    for m in mods:
        m.index_topk = 1 << 20
    try:
        dense = _ref(text, head, TOKENS)
    finally:
        for m in mods:
            m.index_topk = TOP_K
    d = np.abs(dense - ref).max(-1)
    sparse = 3 * KPOOL - 1                 # the first query that sees 3 pools (top-k: 2)
    assert d[:sparse].max() < 1e-5 and d[sparse:].max() > 1e-2


def test_query_chunks_equal_transformers(built, monkeypatch):
    """MLA absorbs a prompt's queries a chunk at a time (the k-pool keep mask's sparse path
    too): at one token a chunk the whole prompt's logits are transformers'."""
    from expertfs.runtime.model import mla
    monkeypatch.setattr(mla, "MLA_QUERY_CHUNK", 1)
    assert np.abs(_ours(built[2], prefill_batch=512) - built[3]).max() <= TOL


@pytest.mark.parametrize("batch", [512, 5, 1], ids=["whole", "batches-of-5", "one-by-one"])
def test_logits_equal_transformers(built, batch):
    ref = built[3]
    ours = _ours(built[2], prefill_batch=batch)
    assert ours.shape == ref.shape
    d = np.abs(ours - ref).max()
    print(f"max |d| {batch}: {d:.3g}")
    assert d <= TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("batch", [512, 5, 1], ids=["whole", "batches-of-5", "one-by-one"])
def test_logits_equal_transformers_through_the_clamped_native_experts(built_f16, batch,
                                                                     monkeypatch):
    """fused on: one-token steps take the native MoE kernel with the SwiGLU clamp inside."""
    from expertfs.runtime import kernels
    if not kernels.available():
        pytest.skip("native kernels unavailable")
    limits = []
    moe = kernels.moe

    def counting(*a, **k):
        y = moe(*a, **k)
        limits.append((a[8] if len(a) > 8 else k.get("limit", 0.0)) if y is not None else None)
        return y
    monkeypatch.setattr(kernels, "moe", counting)
    ref = built_f16[3]
    ours = _ours(built_f16[2], prefill_batch=batch, fused="on")
    d = np.abs(ours - ref).max()
    print(f"max |d| {batch} fused: {d:.3g}")
    assert d <= TOL and (ours.argmax(-1) == ref.argmax(-1)).all()
    if batch == 1:                      # every MoE block of every step, clamped, native
        assert len(limits) == (N_LAYERS - 1) * len(TOKENS) and set(limits) == {1.5}


def test_config_as_llama_cpp_reads_it(built):
    text, _, store, _ = built
    eng = _engine(store)
    try:
        cfg = eng.config
        g = cfg.ext
        assert (cfg.arch, cfg.n_layers, cfg.n_nextn, cfg.n_rot) == ("glm5-next", N_LAYERS, 1, 0)
        assert cfg.gating == 2 and cfg.norm_w and cfg.w_scale == 2.5
        assert g.mla == (False, True, True, False)
        assert g.indexer.full == (False, True, False, False)
        assert (g.indexer.kpool, g.indexer.select_tail, g.indexer.top_k) == (KPOOL, True, TOP_K)
        assert g.clamp_exp == (1.5,) * 5 and g.clamp_shexp == (1.5,) * 5
        assert [b.moe is None for b in eng.trunk.blocks] == [True, False, False, False]
        (blk,) = eng.trunk.nextn
        assert blk.layer == N_LAYERS and blk.moe is not None and blk.attn.indexer is not None
        assert {"eh_proj", "enorm", "hnorm", "shared_head_norm"} <= set(blk.nextn)
        assert eng.store.n_experts(N_LAYERS) == text.config.n_routed_experts
    finally:
        eng.close()
        eng.store.close()


def test_rollback_restores_the_kda_state_inside_a_decode_window(built):
    from expertfs.errors import UsageError
    _, _, store, ref = built
    eng = _engine(store)
    try:
        eng.logits(TOKENS[:14])
        rows = eng.verify(TOKENS[14:19]).numpy()           # a decode window of 5 rows
        assert np.abs(rows - ref[14:19]).max() <= TOL
        assert eng.can_reset(16) and eng.can_reset(0) and not eng.can_reset(9)
        eng.reset(16)                                      # two of them accepted
        tail = eng.logits(TOKENS[16:], reset=False).numpy()
        assert np.abs(tail - ref[16:]).max() <= TOL
        assert not eng.can_reset(9)
        with pytest.raises(UsageError, match="cannot roll back"):
            eng.reset(9)
        eng.reset(0)
        assert np.abs(eng.logits(TOKENS[:6], reset=False).numpy() - ref[:6]).max() <= TOL
    finally:
        eng.close()
        eng.store.close()


@pytest.mark.parametrize("key, value, needle", [
    ("attention.head_count_kv", [0, 1, 1, 0], "block_count 5"),
    ("attention.indexer.kpool", None, "kpool is missing"),
    ("attention.indexer.types", [True, False], "2 entries"),
    ("attention.indexer.types", [True, False, True, True], "first MLA layer"),
    ("swiglu_clamp_exp", [1.5, 1.5], "2 entries for block_count 5"),
    ("hyper_connection.count", None, "hyper_connection.count is missing"),
])
def test_bad_metadata_is_a_typed_error(built, key, value, needle):
    from support.metadata import assert_metadata_refused
    assert_metadata_refused(built[2], "glm5-next", key, value, needle)


@pytest.mark.parametrize("ctx", [8, 64])
def test_plan_counts_the_latent_indexer_and_kda_state_as_the_runtime_holds_them(built, ctx):
    from expertfs.runtime.plan.geometry import kv_cache_bytes
    from expertfs.runtime.plan.model import geometry_from_store
    g = geometry_from_store(built[2])
    eng = _engine(built[2], device="cpu", n_ctx=ctx)
    try:
        cache = eng.model.cache
        cache.reserve(ctx)                          # every position of the context held
        assert cache.capacity == ctx
        assert kv_cache_bytes(g, ctx, "f32") == cache.nbytes
        assert g.state_bytes == eng.model.attend.state.nbytes > 0
        assert kv_cache_bytes(g, 0, "f32") == g.state_bytes   # independent of --ctx
        assert sum(g.indexer_keys) > 0 and cache.stream_nbytes("indexer_pool") > 0
    finally:
        eng.close()
        eng.store.close()
