"""glm-dsa (GLM-5.2) against transformers' GlmMoeDsaForCausalLM, through llama.cpp's converter.

A tiny random model with every feature (a dense leading block, MoE blocks with a shared expert
and a biased sigmoid router, full and shared indexer layers, a prompt three times the tiny
``index_topk`` so the sparse selection runs, a NextN block with its own experts) is saved with
``save_pretrained``, converted to GGUF F32 by llama.cpp's own ``convert_hf_to_gguf.py``
(tools/llamacpp_convert.py), repacked and run by the engine. The seed gives every indexer and
router top-k a clear gap (checked), so both sides choose the same positions and experts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from llamacpp_convert import ConverterUnavailable, convert, tiny_bpe_tokenizer

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.experts.direct import DirectProvider
from expertfs.runtime.mtp.nextn import NextN, nextn_block
from expertfs.store.reader import Store
from expertfs.store.repack import repack

TOL = 1e-3
SEED = 0
N_LAYERS = 4
TOP_K = 8
TOKENS = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(7)).tolist()
DEVICE = os.environ.get("EXPERTFS_TEST_DEVICE", "cpu")
GAP = 1e-4


def _config(n_layers: int = N_LAYERS, **over):
    import transformers as tf
    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=4,
               n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
               routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
               v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1, norm_topk_prob=True,
               rms_norm_eps=1e-6, max_position_embeddings=4096, index_topk=TOP_K,
               index_head_dim=16, index_n_heads=8, first_k_dense_replace=1,
               indexer_types=(["full", "shared", "full", "shared", "full"])[:n_layers],
               num_nextn_predict_layers=1, tie_word_embeddings=False, initializer_range=0.05)
    cfg.update(over)
    return tf.GlmMoeDsaConfig(**cfg)


def _model(seed: int, n_layers: int = N_LAYERS):
    import transformers as tf
    torch.manual_seed(seed)
    m = tf.GlmMoeDsaForCausalLM(_config(n_layers)).eval()
    with torch.no_grad():                     # norms, biases and the router bias not trivial
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
        for layer in m.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return m


def _gaps(model, tokens) -> tuple[float, float]:
    """The smallest gap at the top-k boundary of every indexer row (rows that see more than
    ``index_topk`` positions) and of every router row, from transformers' own modules."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as M
    idx_gaps, route_gaps = [], []

    def on_indexer(mod, args, kwargs):
        x, qr, (cos, sin) = args[:3]                    # hidden_states, q_resid, rope
        B, S, _ = x.shape
        q = mod.wq_b(qr).view(B, S, mod.n_heads, mod.head_dim)
        k = mod.k_norm(mod.wk(x)).unsqueeze(2)
        r = mod.qk_rope_head_dim
        qr_, kr_ = M.apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([qr_, q[..., r:]], -1), torch.cat([kr_, k[..., r:]], -1).squeeze(2)
        s = torch.einsum("bthd,bsd->bths", q, k).relu()
        w = mod.weights_proj(x)
        score = torch.einsum("bth,bths->bts", w, s)[0]
        for t in range(mod.index_topk, S):
            v = score[t, :t + 1].sort(descending=True).values
            idx_gaps.append(float(v[mod.index_topk - 1] - v[mod.index_topk]))

    def on_router(mod, args):
        x = args[0].reshape(-1, mod.hidden_dim).float()
        sel = torch.sigmoid(x @ mod.weight.T) + mod.e_score_correction_bias
        v = sel.sort(-1, descending=True).values
        route_gaps.append(float((v[:, mod.top_k - 1] - v[:, mod.top_k]).min()))

    hooks = [l.self_attn.indexer.register_forward_pre_hook(on_indexer, with_kwargs=True)
             for l in model.model.layers if l.self_attn.indexer is not None]
    hooks += [l.mlp.gate.register_forward_pre_hook(on_router)
              for l in model.model.layers if hasattr(l.mlp, "gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return min(idx_gaps), min(route_gaps)


def _nextn_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The NextN block as GLM checkpoints store it: ``model.layers.{N}`` (a full decoder block
    with its own experts) plus ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.norm``."""
    m5 = _model(seed + 100, N_LAYERS + 1)
    p = f"model.layers.{N_LAYERS}."
    out = {k: v.detach().clone().contiguous() for k, v in m5.state_dict().items()
           if k.startswith(p) and ".mlp.experts." not in k}
    ex = m5.model.layers[N_LAYERS].mlp.experts          # checkpoints store experts one by one
    for e in range(ex.num_experts):
        gate, up = ex.gate_up_proj[e].detach().chunk(2, dim=0)
        for n, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", ex.down_proj[e])):
            out[f"{p}mlp.experts.{e}.{n}.weight"] = t.detach().clone().contiguous()
    g = torch.Generator().manual_seed(seed + 200)
    D = m5.config.hidden_size
    out[p + "eh_proj.weight"] = torch.randn(D, 2 * D, generator=g) * 0.05
    for n in ("enorm", "hnorm", "shared_head.norm"):
        out[p + n + ".weight"] = 1.0 + 0.2 * torch.randn(D, generator=g)
    return out, m5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from safetensors.torch import load_file, save_file
    d = tmp_path_factory.mktemp("glm_dsa")
    model = _model(SEED)
    hf = d / "hf"
    model.save_pretrained(hf)
    tiny_bpe_tokenizer(hf, model.config.vocab_size)
    nextn, m5 = _nextn_tensors(SEED)
    st = hf / "model.safetensors"
    save_file({**load_file(st), **nextn}, st, metadata={"format": "pt"})
    try:
        gguf = convert(hf, d / "model-F32.gguf", outtype="f32")
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp's converter is unavailable: {e}")
    store = str(d / "model.efs")
    repack([str(gguf)], store, force=True)
    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0].numpy()
    return model, m5, nextn, store, ref


def _ours(store: str, tokens=TOKENS, **opts) -> np.ndarray:
    from support.oracle import engine_logits
    return engine_logits(store, tokens, DEVICE, **opts)


def test_the_seed_gives_every_top_k_a_clear_gap(built):
    model = built[0]
    idx_gap, route_gap = _gaps(model, TOKENS)
    assert idx_gap > GAP and route_gap > GAP


def test_the_sparse_selection_changes_the_logits(built):
    """Past index_topk positions a dense MLA would give other logits: the test sees the
    selection (and is exact below it)."""
    model, _, _, _, ref = built
    saved = [l.self_attn.indexer.index_topk for l in model.model.layers
             if l.self_attn.indexer is not None]
    for l in model.model.layers:
        if l.self_attn.indexer is not None:
            l.self_attn.indexer.index_topk = 1 << 20
    try:
        with torch.no_grad():
            dense = model(torch.tensor([TOKENS])).logits[0].numpy()
    finally:
        for l, k in zip([l for l in model.model.layers if l.self_attn.indexer is not None], saved):
            l.self_attn.indexer.index_topk = k
    d = np.abs(dense - ref).max(-1)
    assert d[:TOP_K].max() < 1e-5 and d[TOP_K:].min() > 1e-2


@pytest.mark.parametrize("fused", ["off", "on"])
@pytest.mark.parametrize("batch", [512, 5, 1], ids=["whole", "batches-of-5", "one-by-one"])
def test_logits_equal_transformers(built, batch, fused):
    _, _, _, store, ref = built
    ours = _ours(store, prefill_batch=batch, fused=fused)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_query_chunks_equal_transformers(built, monkeypatch):
    """MLA absorbs a prompt's queries a chunk at a time, on the sparse path too: at one token a
    chunk the whole prompt's logits are transformers'."""
    from expertfs.runtime.model import mla
    monkeypatch.setattr(mla, "MLA_QUERY_CHUNK", 1)
    _, _, _, store, ref = built
    assert np.abs(_ours(store, prefill_batch=512) - ref).max() <= TOL


def test_rollback_rewrites_the_indexer_keys(built):
    _, _, _, store, ref = built
    with Store.open(store) as st:
        eng = Engine(st, DirectProvider(st, DEVICE),
                     EngineOptions(device=DEVICE, dtype="float32", fused="off"))
        try:
            eng.logits(TOKENS[:20])
            eng.reset(11)
            tail = eng.logits(TOKENS[11:], reset=False).numpy()
            stats = eng.stats()
            cache = eng.model.cache
            icfg = eng.config.ext
        finally:
            eng.close()
    assert np.abs(tail - ref[11:]).max() <= TOL
    full = sum(icfg.full)
    assert cache.stream_nbytes("indexer_k") == full * cache.capacity * icfg.head_dim * 4
    assert stats["kv_cache_bytes"] == cache.nbytes > cache.stream_nbytes("indexer_k")


def test_config_and_nextn_block_as_llama_cpp_reads_them(built):
    model, _, _, store, _ = built
    with Engine.open(store, provider="direct", device=DEVICE, dtype="float32") as eng:
        cfg = eng.config
        assert (cfg.arch, cfg.n_layers, cfg.n_nextn) == ("glm-dsa", N_LAYERS, 1)
        assert cfg.gating == 2 and cfg.norm_w and cfg.w_scale == 2.5   # sigmoid, norm, scale
        assert cfg.ext.full == (True, False, True, False) and cfg.ext.top_k == TOP_K
        assert [b.moe is None for b in eng.trunk.blocks] == [True, False, False, False]
        assert [b.attn.indexer is not None for b in eng.trunk.blocks] == list(cfg.ext.full)
        (blk,) = eng.trunk.nextn
        assert blk.layer == N_LAYERS and blk.moe is not None
        assert {"eh_proj", "enorm", "hnorm", "shared_head_norm"} <= set(blk.nextn)
        assert eng.store.n_experts(N_LAYERS) == model.config.n_routed_experts


def test_nextn_block_equals_its_definition(built):
    """The NextN step (llama.cpp's graph_mtp: dense MLA, its own experts, shared head) against
    the same block built from transformers' decoder layer, below index_topk positions."""
    model, m5, nextn, store, _ = built
    p = f"model.layers.{N_LAYERS}."
    T = TOP_K
    ids = torch.tensor(TOKENS[:T])
    h = torch.randn(T, 64, generator=torch.Generator().manual_seed(3))

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    with torch.no_grad():
        e = model.model.embed_tokens(ids)
        x = torch.cat((rms(e, nextn[p + "enorm.weight"]), rms(h, nextn[p + "hnorm.weight"])), -1)
        x = (x @ nextn[p + "eh_proj.weight"].T)[None]
        pos = torch.arange(T)[None]
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        y, _ = m5.model.layers[N_LAYERS](x, attention_mask=mask, position_ids=pos,
                                         position_embeddings=m5.model.rotary_emb(x, pos))
        ref = model.lm_head(rms(y[0], nextn[p + "shared_head.norm.weight"])).numpy()
    with Engine.open(store, provider="direct", device=DEVICE, dtype="float32") as eng:
        blk = nextn_block(eng.model)
        assert blk is not None
        nx = NextN(eng.model, blk, 64)
        ours = nx.forward(ids, h, logits="all").numpy()
    assert np.abs(ours - ref).max() <= TOL


def test_store_verifies_and_unpacks_to_the_same_gguf(built, tmp_path):
    import filecmp

    from expertfs.store.unpack import unpack
    from expertfs.store.verify import verify
    store = built[3]
    gguf = os.path.join(os.path.dirname(store), "model-F32.gguf")
    assert verify(store, [gguf]).ok
    unpack(store, str(tmp_path / "u.gguf"))
    assert filecmp.cmp(tmp_path / "u.gguf", gguf, shallow=False)


@pytest.mark.parametrize("key, value, needle", [
    ("attention.indexer.top_k", None, "top_k"),
    ("attention.indexer.types", [False, True, True, False], "first layer"),
    ("attention.indexer.types", [True, False], "2 entries"),
])
def test_bad_indexer_metadata_is_a_typed_error(built, key, value, needle):
    from support.metadata import assert_metadata_refused
    assert_metadata_refused(built[3], "glm-dsa", key, value, needle)


@pytest.mark.parametrize("ctx", [8, 64])
def test_plan_counts_the_latent_and_indexer_caches_as_the_runtime_holds_them(built, ctx):
    from expertfs.runtime.plan.geometry import kv_cache_bytes
    from expertfs.runtime.plan.model import geometry_from_store
    _, _, _, store, _ = built
    g = geometry_from_store(store)
    with Store.open(store) as st:
        eng = Engine(st, DirectProvider(st, "cpu"),
                     EngineOptions(dtype="float32", fused="off", n_ctx=ctx))
        try:
            cache = eng.model.cache
            cache.reserve(ctx)                          # every position of the context held
            assert cache.capacity == ctx
            assert kv_cache_bytes(g, ctx, "f32") == cache.nbytes
            assert sum(g.indexer_keys) > 0 and cache.stream_nbytes("indexer_k") > 0
        finally:
            eng.close()
