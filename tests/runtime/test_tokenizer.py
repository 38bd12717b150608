"""The GGUF tokenizer: round trips, special tokens, BOS rules, streaming, chat templates; and the
same ids as llama.cpp for every synth vocabulary family (opt-in: EXPERTFS_LLAMA_TESTS=1)."""

from __future__ import annotations

import pytest

from expertfs.errors import UnsupportedModelError, UsageError
from expertfs.runtime.tokenizer.gguf import PRE_SPLITS, GGUFTokenizer, render_chat
from expertfs.synth.tokenizer import FAMILIES, build_vocab

TEXTS = [
    "Hello, world!",
    "Beautiful is better than ugly.\nExplicit is better than implicit.",
    "  leading spaces and   runs   of spaces  ",
    "numbers 1 12 123 1234 12345 3.14159",
    "tabs\tand\r\nwindows lines\n\n\nblank",
    "ünïcödé — “quotes” 日本語 😀 emoji",
    "it's we'll they'RE I'M",
    "",
]


def _kv(arch: str, n_vocab: int = 700, **over):
    v = build_vocab(arch, n_vocab)
    fam = v.family
    kv = {"tokenizer.ggml.model": fam.model, "tokenizer.ggml.pre": fam.pre,
          "tokenizer.ggml.tokens": list(v.tokens), "tokenizer.ggml.token_type": list(v.token_types),
          "tokenizer.chat_template": fam.template, "tokenizer.ggml.eos_token_id": v.id_of(fam.eos)}
    if fam.model == "llama":                    # SentencePiece: scores and the space prefix
        kv.update({"tokenizer.ggml.scores": list(v.scores), "tokenizer.ggml.add_space_prefix": True})
        if fam.unk is not None:
            kv["tokenizer.ggml.unknown_token_id"] = v.id_of(fam.unk)
    else:
        kv["tokenizer.ggml.merges"] = list(v.merges)
    if fam.bos is not None:
        kv["tokenizer.ggml.bos_token_id"] = v.id_of(fam.bos)
    if fam.add_bos is not None:
        kv["tokenizer.ggml.add_bos_token"] = fam.add_bos
    kv.update(over)
    return kv


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_round_trip(arch):
    tok = GGUFTokenizer(_kv(arch))
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert all(0 <= i < tok.n_vocab for i in ids)
        assert tok.decode(ids) == text


def test_merges_are_used():
    tok = GGUFTokenizer(_kv("qwen3moe"))
    text = "Beautiful is better than ugly."
    assert len(tok.encode(text)) < len(text.encode("utf-8"))


def test_special_tokens_parse_only_when_asked():
    tok = GGUFTokenizer(_kv("qwen3moe"))
    im_start = tok.tokens.index("<|im_start|>")
    think = tok.tokens.index("<think>")
    ids = tok.encode("<|im_start|>user<think>")
    assert ids[0] == im_start and think in ids                 # CONTROL and USER_DEFINED whole
    plain = tok.encode("<|im_start|>user<think>", parse_special=False)
    assert im_start not in plain and think in plain             # user-defined always matches
    assert tok.decode(ids) == "user<think>"                    # control tokens are not shown
    assert tok.decode(ids, special=True) == "<|im_start|>user<think>"


def test_bos_rules_follow_llama_cpp():
    llama = GGUFTokenizer(_kv("llama"))                         # add_bos_token = true
    assert llama.encode("hi")[0] == llama.bos_id
    assert llama.encode("<s>hi").count(llama.bos_id) == 1       # never doubled
    qwen = GGUFTokenizer(_kv("qwen3moe"))                       # add_bos_token = false
    assert qwen.bos_id is not None and qwen.encode("hi")[0] != qwen.bos_id
    glm = GGUFTokenizer(_kv("glm4moe"))                         # glm4: no BOS at all
    assert glm.bos_id is None and glm.add_bos is False
    no_key = _kv("llama")
    del no_key["tokenizer.ggml.add_bos_token"]
    assert GGUFTokenizer(no_key).add_bos is True                # llama-bpe defaults to BOS


def test_stop_ids():
    tok = GGUFTokenizer(_kv("qwen3moe"))
    assert tok.tokens.index("<|im_end|>") in tok.stop_ids
    assert tok.eos_id in tok.stop_ids


def test_detokenizer_waits_for_whole_characters():
    tok = GGUFTokenizer(_kv("qwen3moe"))
    text = "a😀b日本"
    ids = tok.encode(text)
    d = tok.detokenizer()
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_chat_templates_render():
    for arch in sorted(FAMILIES):
        tok = GGUFTokenizer(_kv(arch))
        out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert "hi" in out
    q = GGUFTokenizer(_kv("qwen3moe")).apply_chat_template([{"role": "user", "content": "hi"}])
    assert q == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_is_sandboxed():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception) as e:
        render_chat(evil, [])
    assert "unsafe" in str(e.value).lower() or isinstance(e.value, UsageError)
    with pytest.raises(UsageError, match="chat template failed"):
        render_chat("{{ raise_exception('no system role') }}", [])


def test_unsupported_tokenizers_are_typed_errors():
    with pytest.raises(UnsupportedModelError, match="tokenizer model 'bert' .*pre-tokenizer"):
        GGUFTokenizer(_kv("qwen3moe", **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(UnsupportedModelError, match="SPM tokenizer .*scores"):
        GGUFTokenizer(_kv("qwen3moe", **{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer"):
        GGUFTokenizer(_kv("qwen3moe", **{"tokenizer.ggml.pre": "no-such"}))


def test_every_synth_family_has_a_pre_tokenizer():
    """Byte-level BPE families need their pre-tokenizer; SentencePiece ones split no words."""
    assert {f.pre for f in FAMILIES.values() if f.model == "gpt2"} <= set(PRE_SPLITS)


@pytest.mark.llama
@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe", "llama", "deepseek2", "gpt-oss"])
def test_same_ids_as_llama_cpp(tmp_path, arch):
    from llama_cpp import Llama

    from expertfs.synth import SynthConfig, synthesize
    cfg = SynthConfig.tiny(arch).replace(n_vocab=700)
    path = tmp_path / f"{arch}.gguf"
    synthesize(cfg, str(path))
    from expertfs.formats.gguf_read import read_gguf
    kv = {k: e.value for k, e in read_gguf(str(path)).kv.items()}
    tok = GGUFTokenizer(kv)
    m = Llama(str(path), vocab_only=True, verbose=False)
    try:
        for text in TEXTS + ["<|im_start|>user\nhi<|im_end|><think>", "[gMASK]<sop><|user|>\nhi"]:
            ref = m.tokenize(text.encode("utf-8"), add_bos=True, special=True)
            assert tok.encode(text) == ref, text
    finally:
        m.close()


def test_unused_padding_tokens_decode_to_nothing():
    tok = GGUFTokenizer(_kv("qwen3moe"))
    pad = next(i for i, t in enumerate(tok.tokens) if t.startswith("[PAD"))
    hi = tok.encode("hi")
    assert tok.decode(hi + [pad] + hi) == "hihi"
    assert tok.decode([pad], special=True) == ""
