"""The NextN block of glm5-next and glm-dsa as the MTP draft head.

The F32 stores of tests/runtime/model/test_glm5_next.py and test_glm_dsa.py (tiny seeded
transformers models with a NextN block of their own experts, converted by llama.cpp's
converter). glm5-next's NextN step (llama.cpp runs no NextN graph for it) equals the GLM
definition built from transformers' modules: ``eh_proj`` over ``[enorm(embed) ; hnorm(h)]``,
one decoder layer (nope-only MLA, dense below ``index_topk``, no mHC streams), its own experts,
the shared head norm and the output head (glm-dsa's is checked in test_glm_dsa.py). Speculative
decoding with ``--mtp 1``, ``3`` and ``auto`` gives the plain greedy tokens on both, through the
engine and through ``expertfs run``. A random tiny model's drafts are rarely accepted: the
acceptance is printed, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from llamacpp_convert import ConverterUnavailable, convert, tiny_bpe_tokenizer  # noqa: E402
from support.mtp_model import engine, greedy_plain, stats  # noqa: E402

from expertfs.runtime.generate import generate  # noqa: E402
from expertfs.runtime.sampling import Sampler  # noqa: E402
from expertfs.store.repack import repack  # noqa: E402

TOL = 1e-3
N = 16
PROMPT = [5, 100, 200, 37, 300, 12, 7, 250, 255, 1, 2, 3]


def _glm5_next(d: Path):
    import test_glm5_next as G
    from safetensors.torch import save_file
    text, head = G._model(G.SEED)
    hf = d / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(G._hf_config(text.config)))
    tiny_bpe_tokenizer(hf, G.VOCAB)
    t5, _ = G._model(G.SEED + 100, G.N_LAYERS + 1)
    p = f"model.layers.{G.N_LAYERS}."
    nx = {k: v for k, v in G._checkpoint(t5, None, G.N_LAYERS, nextn=True).items()
          if k.startswith(p)}
    g = torch.Generator().manual_seed(G.SEED + 200)
    D = text.config.hidden_size
    nx[p + "eh_proj.weight"] = torch.randn(D, 2 * D, generator=g) * 0.05
    for n in ("enorm", "hnorm", "shared_head.norm"):
        nx[p + n + ".weight"] = 1.0 + 0.2 * torch.randn(D, generator=g)
    save_file({**G._checkpoint(text, head), **nx}, hf / "model.safetensors",
              metadata={"format": "pt"})
    return hf, dict(text=text, head=head, t5=t5, nextn=nx)


def _glm_dsa(d: Path):
    import test_glm_dsa as G
    from safetensors.torch import load_file, save_file
    model = G._model(G.SEED)
    hf = d / "hf"
    model.save_pretrained(hf)
    tiny_bpe_tokenizer(hf, model.config.vocab_size)
    nextn, _ = G._nextn_tensors(G.SEED)
    st = hf / "model.safetensors"
    save_file({**load_file(st), **nextn}, st, metadata={"format": "pt"})
    return hf, dict(model=model)


@pytest.fixture(scope="module", params=["glm5-next", "glm-dsa"])
def built(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    hf, parts = (_glm5_next if arch == "glm5-next" else _glm_dsa)(d)
    try:
        gguf = convert(hf, d / "model-F32.gguf", outtype="f32")
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp's converter is unavailable: {e}")
    store = d / "model.efs"
    repack([str(gguf)], str(store), force=True)
    with engine(store) as (eng, _):
        plain = greedy_plain(eng, PROMPT, N)
    return arch, store, parts, plain


def test_glm5_next_nextn_block_equals_its_definition(built):
    arch, store, parts, _ = built
    if arch != "glm5-next":
        pytest.skip("glm-dsa's NextN block: test_glm_dsa.py::test_nextn_block_equals_its_definition")
    import test_glm5_next as G

    from expertfs.runtime.mtp.nextn import NextN, nextn_block
    text, head, t5, nx = parts["text"], parts["head"], parts["t5"], parts["nextn"]
    p, T = f"model.layers.{G.N_LAYERS}.", G.TOP_K
    eps = text.config.rms_norm_eps
    ids = torch.tensor(PROMPT[:T])
    h = torch.randn(T, text.config.hidden_size, generator=torch.Generator().manual_seed(3))

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    layer = t5.layers[G.N_LAYERS]
    with torch.no_grad():
        e = text.embed_tokens(ids)
        z = torch.cat((rms(e, nx[p + "enorm.weight"]), rms(h, nx[p + "hnorm.weight"])), -1)
        x = (z @ nx[p + "eh_proj.weight"].T)[None]
        a, _, _ = layer.self_attn(hidden_states=layer.input_layernorm(x),
                                  attention_mask=torch.ones(1, T, dtype=torch.bool),
                                  position_ids=torch.arange(T)[None], cache=None,
                                  use_cache=False, position_embeddings=None)
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        ref = head(rms(x[0], nx[p + "shared_head.norm.weight"])).numpy()
    with engine(store) as (eng, _):
        blk = nextn_block(eng.model)
        assert blk is not None and blk.moe is not None
        ours = NextN(eng.model, blk, 64).forward(ids, h, logits="all").numpy()
    d = np.abs(ours - ref).max()
    print(f"glm5-next NextN max |d|: {d:.3g}")
    assert d <= TOL


@pytest.mark.parametrize("mtp", [1, 3, "auto"])
def test_speculative_greedy_equals_plain(built, mtp):
    arch, store, _, plain = built
    with engine(store, mtp=mtp) as (eng, sp):
        out = [s.token for s in generate(eng, PROMPT, Sampler(), N, spec=sp.speculator)]
        m = stats(eng, sp)["mtp"]
    print(f"{arch} --mtp {mtp}: drafted {m['drafted']} accepted {m['accepted']} acceptance {m['acceptance']} "
          f"tokens/step {m['tokens_per_step']:.2f}")
    assert out == plain
    assert m["steps"] > 0 and (m["drafted"] > 0 or mtp == "auto")


def test_cli_run_with_mtp_gives_the_plain_tokens(built):
    arch, store, _, _ = built
    base = [sys.executable, "-m", "expertfs", "run", str(store), "-p", "hello world", "-n", "8",
            "--ignore-eos", "--json", "--fused", "off", "-t", "1"]
    outs = {}
    for mtp in ("0", "1"):                   # auto's gate: test_speculative_greedy_equals_plain
        r = subprocess.run(base + ["--mtp", mtp], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs[mtp] = json.loads(r.stdout)
    assert outs["1"]["tokens"] == outs["0"]["tokens"]
    m = outs["1"]["stats"]["mtp"]
    assert m["steps"] >= 1 and m["drafted"] >= 1
    print(f"{arch} expertfs run --mtp 1: acceptance {m['acceptance']} "
          f"tokens/step {m['tokens_per_step']:.2f}")


def _oracle(eng, sp, truth: list[int], wrong_every: int):
    """Drafts the plain continuation, with a wrong token every ``wrong_every``-th draft, so
    verify windows are accepted in full and in part (the KDA state, the latent and indexer
    caches roll back inside the window)."""
    calls = iter(range(1 << 30))

    def fn(logits, params, gen):
        i = sp.speculator.nextn.pos - len(PROMPT)
        t = truth[i] if 0 <= i < len(truth) else 0
        if wrong_every and next(calls) % wrong_every == wrong_every - 1:
            t = (t + 1) % eng.config.n_vocab
        return t, None, 0.9
    return fn


@pytest.mark.parametrize("k,wrong", [(3, 0), (3, 2)])
def test_greedy_equals_plain_with_partly_right_drafts(built, k, wrong):
    _, store, _, plain = built
    with engine(store, mtp=k) as (eng, sp):
        sp.speculator.draft_fn = _oracle(eng, sp, plain, wrong)
        out = [s.token for s in generate(eng, PROMPT, Sampler(), N, spec=sp.speculator)]
        st = sp.speculator.stats
    assert out == plain
    assert (st.accepted == st.drafted) if wrong == 0 else (0 < st.accepted < st.drafted)
