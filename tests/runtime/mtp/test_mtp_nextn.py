"""The NextN/MTP forward against an independent implementation (transformers' ``MtpLayer``
around a ``Glm4MoeDecoderLayer``, the training script's model) at float32 tolerance: the
catch-up over a prompt (token p paired with the trunk's h_{p-1}, zero h for the first token as
llama.cpp pairs it), a chained draft step (the block's own hn as h), the trunk's hidden states,
and the KV-cache rollback."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.mtp_model import build_model, engine, one_thread  # noqa: F401

torch = pytest.importorskip("torch")

PROMPT = [5, 100, 200, 37, 400, 12, 7, 300, 255, 1, 2, 3, 77, 500, 9, 64, 31, 8]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("nextn"))


def _reference(model, ids: list[int], chain: int):
    """Trunk hidden states, NextN hn and logits of the catch-up rows and ``chain`` greedy
    chained drafts, by full recomputation in transformers."""
    T = len(ids)
    with torch.no_grad():
        x = torch.tensor([ids])
        h = model.trunk(x)[0]                                       # [T, D] after the norm
        toks = list(ids)
        hin = [torch.zeros(h.shape[1])] + [h[i] for i in range(T - 1)]
        hns, logits = None, None
        for _ in range(chain + 1):
            pos = torch.arange(len(toks))[None]
            hns = model.nextn(torch.tensor([toks]), torch.stack(hin)[None], pos)[0]
            logits = model.logits(hns)
            d = int(logits[-1].argmax())
            toks.append(d)
            hin.append(hns[-1])
        return h, hns, logits, toks[T:]


def test_nextn_matches_transformers(tiny) -> None:
    model, _, store = tiny
    ref_h, ref_hn, ref_logits, ref_drafts = _reference(model, PROMPT, chain=2)
    with engine(store, mtp=2) as (eng, sp):
        eng.prefill(PROMPT[:-1])
        eng.decode(PROMPT[-1])                                        # hidden kept by both paths
        spec = sp.speculator
        T = len(PROMPT)
        h = spec.h_at(0, T)
        assert torch.allclose(h, ref_h, atol=1e-4, rtol=1e-4), (h - ref_h).abs().max()
        assert spec.h_at(-1, 1)[0].abs().max() == 0                 # the first token's zero h
        nx = spec.nextn
        got = nx.forward(torch.tensor(PROMPT), spec.h_at(-1, T - 1), logits="all")
        hn = nx.hidden
        scale = ref_logits.abs().max()
        assert (got - ref_logits[:T]).abs().max() < 1e-4 * scale, (got - ref_logits[:T]).abs().max()
        assert torch.allclose(hn, ref_hn[:T], atol=1e-4, rtol=1e-4)
        drafts = [int(got[-1].argmax())]
        for i in range(2):                                          # chained: (d, own hn)
            lg = nx.forward(torch.tensor([drafts[-1]]), nx.hidden[-1:], logits="last")
            assert (lg[0] - ref_logits[T + i]).abs().max() < 1e-4 * scale
            drafts.append(int(lg[0].argmax()))
        assert drafts == ref_drafts
        assert nx.pos == T + 2
        # roll back the chained rows and redo one: the same logits again
        nx.reset(T)
        lg = nx.forward(torch.tensor([drafts[0]]), hn[-1:], logits="last")
        assert (lg[0] - ref_logits[T]).abs().max() < 1e-4 * scale


def test_mtp_block_experts_go_through_the_provider(tiny) -> None:
    _, _, store = tiny
    with engine(store, mtp=1) as (eng, sp):
        L = eng.config.n_layers
        eng.prefill(PROMPT)
        before = eng.provider.stats.requests
        sp.speculator._draft0(7, eng.model.pos)
        assert eng.provider.stats.requests > before                 # layer L's experts read
        assert sp.speculator.nextn.layer == L


def test_no_nextn_block_is_a_usage_error(tmp_path: Path) -> None:
    from expertfs.errors import UsageError
    from hf_to_gguf import convert
    _, _, store = convert("glm4moe", str(tmp_path), seed=3, num_hidden_layers=2)
    with pytest.raises(UsageError):
        engine(Path(store), mtp=2)
    with pytest.raises(UsageError):
        engine(Path(store), draft_prefetch=True)


def test_catch_up_rows_fill_the_kv_without_experts(tiny) -> None:
    """K/V come from the block's input: a catch-up without FFN, then the last row, equals the
    full forward's last row, and the catch-up reads no expert."""
    _, _, store = tiny
    with engine(store, mtp=1) as (eng, sp):
        eng.prefill(PROMPT)
        spec, nx = sp.speculator, sp.speculator.nextn
        T = len(PROMPT)
        full = nx.forward(torch.tensor(PROMPT), spec.h_at(-1, T - 1), logits="all")
        nx.reset(0)
        before = eng.provider.stats.requests
        assert nx.forward(torch.tensor(PROMPT[:-1]), spec.h_at(-1, T - 2), logits="none") is None
        assert eng.provider.stats.requests == before and nx.pos == T - 1
        last = nx.forward(torch.tensor(PROMPT[-1:]), spec.h_at(T - 2, T - 1), logits="last")
        assert torch.allclose(last[0], full[-1], atol=1e-5, rtol=1e-5)
        nx.reset(T - 1)
        assert nx.forward(torch.tensor(PROMPT[-1:]), spec.h_at(T - 2, T - 1), "hidden") is None
        assert nx.hidden.shape[0] == 1


def test_fixture_builds(tmp_path: Path) -> None:
    model, gguf, store = build_model(tmp_path)
    assert gguf.exists() and (store / "index.lmdb").exists()
    assert model.n_layers == 3
