"""The server session with MTP on: the same greedy text as without, prompt-prefix reuse over
the speculative KV state, draft counts in the timings; and ``expertfs run --mtp`` end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.mtp_model import build_model, engine, one_thread  # noqa: F401

from expertfs.runtime.server.schema import parse_completion  # noqa: E402
from expertfs.runtime.server.session import Session  # noqa: E402
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer  # noqa: E402

PROMPT = "def main(args):\n    return"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("serve"), seed=2)[2]


def _complete(sess: Session, prompt: str, n: int, **kw) -> tuple[str, dict]:
    req = parse_completion({"prompt": prompt, "max_tokens": n, "temperature": 0, **kw})
    out: list[str] = []
    res = sess.run(req, sess.prompt_ids(req), out.append, lambda: False)
    assert "".join(out) == res.text
    return res.text, res.timings


def test_session_text_equals_plain_and_prefix_is_reused(store):
    texts = {}
    for mtp in (0, 3):
        with engine(store, mtp=mtp) as (eng, sp):
            sess = Session(eng, GGUFTokenizer(eng.kv, str(store)),
                           sp.speculator if sp is not None else None)
            a, ta = _complete(sess, PROMPT, 12)
            b, tb = _complete(sess, PROMPT + a, 9)         # extends the cached conversation
            assert tb["cache_n"] >= len(sess.prompt_ids(parse_completion(
                {"prompt": PROMPT}))) - 1
            assert len(sess.cached) == eng.pos                # exactly what the KV holds
            if mtp:
                assert sess.cached == sp.speculator.tokens
            texts[mtp] = (a, b)
            if mtp:
                assert ta["draft_n"] > 0 and 0 <= ta["draft_n_accepted"] <= ta["draft_n"]
            else:
                assert "draft_n" not in ta
    assert texts[0] == texts[3]


def test_cli_run_with_mtp_prints_its_figures(store):
    r = subprocess.run([sys.executable, "-m", "expertfs", "run", str(store), "-p", PROMPT,
                        "-n", "10", "--mtp", "2", "--draft-prefetch", "--ignore-eos", "--json",
                        "--fused", "off", "-t", "1", "--ram", "2M"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["generated_tokens"] == 10
    m = d["stats"]["mtp"]
    assert m["steps"] >= 1 and "draft_prefetch" in m
    plain = subprocess.run([sys.executable, "-m", "expertfs", "run", str(store), "-p", PROMPT,
                            "-n", "10", "--ignore-eos", "--json", "--fused", "off", "-t", "1",
                            "--ram", "2M"], capture_output=True, text=True)
    assert json.loads(plain.stdout)["tokens"] == d["tokens"]
    bad = subprocess.run([sys.executable, "-m", "expertfs", "run", str(store), "-p", "x",
                          "--mtp", "many"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--mtp" in bad.stderr


def test_mtp_auto_on_a_store_without_a_draft_block_decodes_plainly(tmp_path):
    """``--mtp auto`` picks the draft depth, none where the store has no NextN block (one
    command line for every model, with a warning); an explicit depth there is refused."""
    from expertfs.store.repack import repack
    from expertfs.synth import SynthConfig, synthesize
    gguf, store = tmp_path / "plain.gguf", tmp_path / "plain.efs"
    synthesize(SynthConfig.tiny("qwen3moe"), str(gguf))
    repack([str(gguf)], str(store))
    base = [sys.executable, "-m", "expertfs", "run", str(store), "-p", "hello", "-n", "4",
            "--ignore-eos", "--json", "-t", "1"]
    auto = subprocess.run(base + ["--mtp", "auto"], capture_output=True, text=True)
    assert auto.returncode == 0, auto.stderr
    assert "no NextN/MTP block" in auto.stderr
    d = json.loads(auto.stdout)
    assert "mtp" not in d["stats"]
    assert d["tokens"] == json.loads(subprocess.run(base, capture_output=True,
                                                    text=True).stdout)["tokens"]
    fixed = subprocess.run(base + ["--mtp", "2"], capture_output=True, text=True)
    assert fixed.returncode != 0 and "no NextN/MTP block" in fixed.stderr
