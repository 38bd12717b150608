"""The trained glm4moe fixture (tools/train_tiny_moe.py → GGUF → store → realistic traces).

One module-scoped build of the ``tiny`` preset (a few hundred steps on the stdlib's sources)
feeds every test: the model learns, the GGUF reads back through gguf-py and
``expertfs.formats.gguf_read`` with llama.cpp's names and keys (NextN block included), the store
repacks and verifies byte-equal, and both routing traces read back with the model's geometry.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

_layers = pytest.importorskip("transformers.modeling_layers")
if not hasattr(_layers, "MtpLayer"):
    pytest.skip("this transformers has no MtpLayer (5.24 has)", allow_module_level=True)
pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")


import export_glm4moe_gguf as ex  # noqa: E402
import make_realistic_traces as mrt  # noqa: E402
from train_tiny_moe_model import PRESETS, load_checkpoint  # noqa: E402

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("trained")
    s = mrt.pipeline(str(out), preset="tiny", seed=0, tokens=1024, segment=128, drafts=2,
                     log=lambda *_: None)
    s["out"] = out
    return s


def test_loss_decreases(built: dict) -> None:
    m = json.loads((built["out"] / "run" / "metrics.json").read_text())
    uniform = math.log(TINY.vocab)
    assert m["initial_held_out_loss"] > uniform - 0.1
    assert m["held_out_loss"] < uniform - 1.5, m["held_out_loss"]
    curve = [p["held_out_loss"] for p in m["curve"]]
    assert curve[-1] < curve[0] - 1.5 and curve[-1] <= min(curve) + 0.05
    assert m["held_out_mtp_loss"] < uniform - 1.5
    assert m["mtp_next_next_top1"] > 20 / TINY.vocab         # far above chance
    for layer, b in m["balance"].items():                      # every expert in use
        assert b["used"] == TINY.experts, (layer, b)
    log = (built["out"] / "run" / "train_log.jsonl").read_text().splitlines()
    assert sum(1 for line in log if '"eval"' not in line) == TINY.steps


def test_gguf_reads_back(built: dict) -> None:
    from gguf import GGUFReader

    from expertfs.formats.gguf_split import read_model
    path = built["gguf"]["path"]
    L = TINY.layers
    r = GGUFReader(path)
    kv = {f.name: f for f in r.fields.values()}

    def val(key: str):
        f = kv[key]
        return f.contents()

    assert val("general.architecture") == "glm4moe"
    assert val("glm4moe.block_count") == L + 1
    assert val("glm4moe.nextn_predict_layers") == 1
    assert val("glm4moe.expert_count") == TINY.experts
    assert val("glm4moe.expert_used_count") == TINY.top_k
    assert val("glm4moe.leading_dense_block_count") == 1
    assert val("glm4moe.expert_gating_func") == 2
    assert val("tokenizer.ggml.model") == "gpt2"
    assert val("tokenizer.ggml.pre") == "glm4"
    tokens = val("tokenizer.ggml.tokens")
    assert len(tokens) == TINY.vocab and tokens[val("tokenizer.ggml.bos_token_id")] == "[gMASK]"
    assert tokens[val("tokenizer.ggml.eos_token_id")] == "<|endoftext|>"
    assert len(val("tokenizer.ggml.merges")) > 100
    assert "tokenizer.chat_template" in kv
    names = {t.name for t in r.tensors}
    for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm"):
        assert f"blk.{L}.nextn.{n}.weight" in names
    for n in ("ffn_gate_inp.weight", "exp_probs_b.bias", "ffn_up_exps.weight",
              "ffn_down_shexp.weight", "attn_q_norm.weight"):
        assert f"blk.{L}.{n}" in names                       # the NextN block's own MoE
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_inp.weight" not in names
    m = read_model(path)
    assert len(m.tensors) == len(r.tensors) == built["gguf"]["tensors"]
    up = m.by_name["blk.1.ffn_up_exps.weight"]
    assert up.ne == (TINY.hidden, TINY.moe_ff, TINY.experts)
    assert m.by_name["blk.1.ffn_down_exps.weight"].ne == (TINY.moe_ff, TINY.hidden, TINY.experts)
    assert m.arch_value("nextn_predict_layers") == 1


def test_gguf_weights_match_the_model(built: dict) -> None:
    """The torch model holding the GGUF's weights predicts what the checkpoint predicts."""
    run = built["out"] / "run"
    a, _ = load_checkpoint(str(run / "model.pt"))
    b, _ = load_checkpoint(str(run / "model.pt"))
    ex.load_gguf_weights(b, built["gguf"]["path"])
    held = np.load(run / "held_out.npy").astype(np.int64)[:256]
    ids = torch.from_numpy(held)[None]
    with torch.no_grad():
        la, lb = a.logits(a.trunk(ids)), b.logits(b.trunk(ids))
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean() > 0.97
    # F16 rounding only (a near-tie can flip a route somewhere, so not the max)
    assert (la - lb).abs().mean() < 0.01


def test_store_verifies(built: dict) -> None:
    r = subprocess.run([sys.executable, "-m", "expertfs", "verify", built["store"], "--source",
                        built["gguf"]["path"]], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_traces_read_back(built: dict) -> None:
    from expertfs.runtime.trace.file import TraceReader
    from expertfs.store.reader import Store
    L, k, E = TINY.layers, TINY.top_k, TINY.experts
    moe = list(range(1, L))
    with Store.open(built["store"]) as s:
        extent = {i: int(s.layer_info(i)["extent_bytes"]) for i in s.layers}
    assert sorted(extent) == moe + [L]                       # trunk MoE layers + NextN
    n_tok = built["traces"]["tokens"]
    assert n_tok == 1024

    with TraceReader(built["traces"]["decode_trace"]["path"]) as r:
        h = r.header
        assert (h.n_layers, h.n_experts, h.k, h.n_draft) == (L, E, k, 0)
        assert h.expert_bytes == tuple([0] + [extent[i] for i in moe])
        rows = [c for c in r.chunks()]
    layers = np.concatenate([c.layers for c in rows])
    tokens = np.concatenate([c.tokens for c in rows])
    experts = np.concatenate([c.experts for c in rows])
    w = np.concatenate([c.weights for c in rows]).astype(np.float32)
    assert len(layers) == n_tok * len(moe)
    assert (tokens == np.repeat(np.arange(n_tok), len(moe))).all()
    assert (layers == np.tile(moe, n_tok)).all()
    assert np.allclose(w.sum(1), 1.0, atol=5e-3) and (np.diff(w, axis=1) <= 1e-3).all()
    for layer in moe:                                        # realistic: skewed but all used
        cnt = np.bincount(experts[layers == layer].ravel(), minlength=E)
        assert (cnt > 0).sum() >= E - 1

    with TraceReader(built["traces"]["mtp_trace"]["path"]) as r:
        h = r.header
        assert (h.n_layers, h.n_experts, h.k, h.n_draft) == (L + 1, E, k, 2)
        assert h.expert_bytes[L] == extent[L] and h.meta["mtp_layer"] == L
        cs = list(r.chunks())
    lay = np.concatenate([c.layers for c in cs])
    tok = np.concatenate([c.tokens for c in cs])
    nv = np.concatenate([c.n_valid for c in cs])
    dex = np.concatenate([c.draft_experts for c in cs])
    assert (lay == L).sum() == n_tok - n_tok // 128          # no NextN row at a segment start
    assert (nv[lay == L] == 1).all() and (nv[(lay < L) & (tok % 128 != 0)] == 2).all()
    assert (nv[tok % 128 == 0] == 0).all()
    main_rows = (lay < L) & (nv == 2)
    d = dex[main_rows]
    assert all(len(set(x.tolist())) == k for x in d.reshape(-1, k))


def test_accepted_drafts_route_like_the_next_token(built: dict) -> None:
    """A draft that equals the next text token is that token: the verify batch routes it
    exactly as the trunk routes the next position (the tree mask is right)."""
    st = json.loads((built["out"] / "traces" / "trace_stats.json").read_text())
    assert st["verify_vs_plain_route_mismatch_rows"] == 0
    assert 0.05 < st["draft_top1_vs_text"][0] < 0.6
    for layer, v in st["layers"].items():
        assert v["draft_route_overlap_next_if_accepted"] > 0.99, (layer, v)
        assert v["draft_route_overlap_next_if_rejected"] < 0.95


def test_bench_cache_runs_on_the_trace(built: dict) -> None:
    r = subprocess.run([sys.executable, "-m", "expertfs", "bench", "cache", "--trace",
                        built["traces"]["decode_trace"]["path"], "--policies", "lru,wlfu",
                        "--capacity", "16", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "belady" in r.stdout.lower() or "opt" in r.stdout.lower()


def test_training_is_deterministic(tmp_path: Path) -> None:
    import train_tiny_moe as tr
    from train_tiny_moe_model import preset
    p = preset("tiny", steps=8, corpus_chars=200_000, held_chars=40_000, eval_every=8)
    sds = []
    for d in ("a", "b"):
        tr.train(str(tmp_path / d), p, 3, 1, "padded_bmm", log=lambda *_: None)
        m, _ = load_checkpoint(str(tmp_path / d / "model.pt"))
        sds.append(m.state_dict())
    assert all(torch.equal(sds[0][k], sds[1][k]) for k in sds[0])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == \
        (tmp_path / "b" / "tokenizer.json").read_bytes()


@pytest.mark.llama
def test_llama_cpp_agrees(built: dict) -> None:
    pytest.importorskip("llama_cpp")
    res = ex.check_llama(str(built["out"] / "run"), built["gguf"]["path"], n_prompts=2,
                         n_gen=16)
    assert res["top1_agreement"] >= 0.95, res
    assert res["tokenization_identical"] == "2/2", res


@pytest.mark.llama
def test_llama_cpp_nextn_agrees(built: dict) -> None:
    """llama.cpp's own MTP graph on the exported NextN tensors drafts what torch drafts."""
    pytest.importorskip("llama_cpp")
    res = ex.check_llama_mtp(str(built["out"] / "run"), built["gguf"]["path"], n_tokens=48)
    assert res["top1_agreement"] >= 0.95 and res["max_abs_dlogit"] < 0.05, res


def test_trunk_tensors_equal_hf_to_gguf(built: dict, tmp_path: Path) -> None:
    """tools/hf_to_gguf.py (the project's transformers → GGUF converter) writes the trained
    trunk with the same names, types, shapes and bytes as this exporter (which adds the NextN
    block and the trained tokenizer, which that converter has no hook for)."""
    hf = pytest.importorskip("hf_to_gguf")
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader
    model, _ = load_checkpoint(str(built["out"] / "run" / "model.pt"))
    theirs = tmp_path / "hf.gguf"
    hf.write_gguf(model.lm, "glm4moe", str(theirs), expert_type=T.F16, matrix_type=T.F16)
    a = {t.name: t for t in GGUFReader(built["gguf"]["path"]).tensors}
    b = {t.name: t for t in GGUFReader(str(theirs)).tensors}
    trunk = {n for n in a if not n.startswith(f"blk.{TINY.layers}.")}
    assert trunk == set(b)
    for n in trunk:
        assert a[n].tensor_type == b[n].tensor_type, n
        assert list(a[n].shape) == list(b[n].shape), n
        assert np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data)), n


def test_padded_bmm_experts_equal_eager() -> None:
    """The training kernel computes transformers' Glm4MoeExperts (eager loop), grads too."""
    from train_tiny_moe_model import TinyGlmMoe, preset
    m = TinyGlmMoe(preset("tiny"), seed=5)
    ex_mod = m.lm.model.layers[1].mlp.experts
    with torch.no_grad():
        ex_mod.gate_up_proj.normal_(0, 0.2)
        ex_mod.down_proj.normal_(0, 0.2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, TINY.hidden, generator=g)
    idx = torch.stack([torch.randperm(TINY.experts, generator=g)[:TINY.top_k] for _ in range(37)])
    w = torch.rand(37, TINY.top_k, generator=g)
    outs = []
    for impl in ("eager", "padded_bmm"):
        m.set_experts(impl)
        ex_mod.zero_grad()
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        y = ex_mod(xi, idx, wi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append((y.detach(), xi.grad, wi.grad, ex_mod.gate_up_proj.grad.clone(),
                     ex_mod.down_proj.grad.clone()))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
