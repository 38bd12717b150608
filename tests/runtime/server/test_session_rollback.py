"""A follow-up request resumes from the longest shared prefix the model can go back to.

gpt-oss's sliding-window layers keep a ring (two windows) plus checkpoints one window after a
prompt's end, so some shared positions cannot be gone back to: the session then resumes from
the nearest one below that can, not from 0, and its reply (tokens and logprobs) is the reply a
fresh prefill gives. A model with a whole-context cache resumes from the whole shared prefix,
as before."""

from __future__ import annotations

import pytest

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.server.schema import parse_completion
from expertfs.runtime.server.session import Session, resume_point
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
from expertfs.store.repack import repack
from expertfs.synth import SynthConfig, synthesize

WINDOW = 8                     # the ring holds 2 windows; the context is longer, so checkpoints
N_CTX = 128
PROMPT = 20
NEW = 24


def _store(d, arch: str, **over) -> str:
    g = synthesize(SynthConfig.tiny(arch, **over), str(d / "m.gguf"))
    repack(g, str(d / "m.efs"))
    return str(d / "m.efs")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return _store(tmp_path_factory.mktemp("oss"), "gpt-oss", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _store(tmp_path_factory.mktemp("qwen"), "qwen3moe")


def _open(store):
    eng = Engine.open(store, provider="direct", options=EngineOptions(n_ctx=N_CTX))
    return eng, Session(eng, GGUFTokenizer(eng.kv))


def _req(sess, prompt, max_tokens):
    """Greedy, with logprobs, the stop tokens banned so every request runs its length."""
    return parse_completion({"prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                             "logprobs": 2,
                             "logit_bias": {str(t): -100 for t in sess.tok.stop_ids}})


def _run(sess, prompt, max_tokens=6):
    req = _req(sess, prompt, max_tokens)
    return sess.run(req, sess.prompt_ids(req), lambda s: None, lambda: False)


def _same(a, b):
    assert a.text == b.text and a.completion_tokens == b.completion_tokens
    assert [e["token"] for e in a.logprobs] == [e["token"] for e in b.logprobs]
    for x, y in zip(a.logprobs, b.logprobs):
        assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)


def _turns(store, shared: int):
    """A first request (a prompt, then a reply), then one that shares ``shared`` of the first's
    tokens and goes on differently; and the second one on a fresh engine."""
    eng, sess = _open(store)
    try:
        _run(sess, range(3, 3 + PROMPT), NEW)
        held = list(sess.cached)
        assert len(held) == PROMPT + NEW - 1 == eng.pos
        follow = held[:shared] + [7, 11, 13, 17, 19]
        settle = {p: eng.can_reset(p) for p in range(eng.pos + 1)}
        second = _run(sess, follow)
    finally:
        eng.close()
    eng, sess = _open(store)
    try:
        fresh = _run(sess, follow)
    finally:
        eng.close()
    return settle, second, fresh


@pytest.mark.parametrize("shared", [31, PROMPT + 3, 10])
def test_gpt_oss_resumes_from_the_nearest_position_its_ring_keeps(gpt_oss, shared):
    can, second, fresh = _turns(gpt_oss, shared)
    # the ring holds the last two windows; the checkpoint one window past the prompt's end
    assert not can[31] and can[PROMPT + WINDOW] and not can[PROMPT + WINDOW + 1]
    assert can[PROMPT + NEW - 1] and not can[10] and can[0]
    want = max(p for p in range(shared + 1) if can[p])
    assert second.timings["cache_n"] == want
    assert second.timings["prompt_n"] == shared + 5 - want
    assert want == {31: PROMPT + WINDOW, PROMPT + 3: PROMPT + 3, 10: 0}[shared]
    assert fresh.timings["cache_n"] == 0
    _same(second, fresh)


def test_a_whole_context_cache_resumes_from_the_whole_shared_prefix(qwen):
    can, second, fresh = _turns(qwen, 31)
    assert all(can.values())
    assert second.timings["cache_n"] == 31 and fresh.timings["cache_n"] == 0
    _same(second, fresh)


def test_resume_point_probes_down_to_what_the_engine_keeps(gpt_oss):
    eng, sess = _open(gpt_oss)
    try:
        assert resume_point(eng, 5) == 5          # nothing run yet: anywhere ahead is fine
        _run(sess, range(3, 3 + PROMPT), NEW)
        assert resume_point(eng, eng.pos) == eng.pos
        assert resume_point(eng, 31) == PROMPT + WINDOW
        assert resume_point(eng, 12) == 0
    finally:
        eng.close()
