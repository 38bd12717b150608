"""The GGUF tokenizer against llama.cpp's own references.

1. Every case of every reference vocabulary llama.cpp ships (``models/ggml-vocab-*.gguf`` with
   ``.inp``/``.out``, from the llama-cpp-python 0.3.36 source package that
   tools/llamacpp_convert.py finds in or downloads into the cache): the same token ids, read as
   llama.cpp's tests/test-tokenizer-0.cpp reads them (no BOS, special tokens not parsed).
2. Pre-tokenizers without a reference vocabulary (``kimi-k2``, ``deepseek-v3``, ...): the same
   word splits as llama.cpp's ``unicode_regex_split`` (src/unicode.cpp, compiled once into the
   cache with a small driver) on all those reference texts and a few more.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from expertfs.errors import UnsupportedModelError
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
from expertfs.runtime.tokenizer.pre import PRE_SPLITS

#: reference vocabularies of families with MoE models (and the BPE ones that come for free)
VOCABS = ["qwen2", "qwen35", "llama-bpe", "gpt-2", "mpt", "deepseek-llm", "deepseek-coder",
          "llama-spm", "phi-3", "command-r", "falcon", "refact", "starcoder"]
REFUSED = {"bert-bge": "bert", "gemma-4": "gemma4"}
SEP = "\n__ggml_vocab_test__\n"
EXTRA = ["HelloWorld camelCase XMLHttpRequest I'M we'LL", "中文测试，日本語のテキスト。한국어 텍스트",
         "混合English和中文123456", "  \n\n  \t tabs\r\n", "emoji 🦙🦙 and 1,234,567.89",
         "кирилица Ünïcödé ǅ ﬁ 𝔘𝔫𝔦", "a\u0301e\u0301 combining", "'s 'T 're", "x\u3000y\u00a0z", "中文\u3000测试\u2003x"]


def _models() -> Path:
    from llamacpp_convert import ConverterUnavailable, source_dir
    try:
        return source_dir() / "models"
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp reference vocabularies unavailable: {e}")


def _cases(path: Path) -> list[tuple[str, list[int]]]:
    """``(text, ids)`` pairs, split as test-tokenizer-0.cpp's ``read_tests`` splits them."""
    raw = path.with_name(path.name + ".inp").read_bytes().decode("utf-8")
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    outs = path.with_name(path.name + ".out").read_bytes().decode("utf-8").split("\n")
    assert len(outs) >= len(texts)
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


def _kv(path: Path) -> dict:
    from expertfs.formats.gguf_read import read_gguf
    return {k: e.value for k, e in read_gguf(str(path)).kv.items()}


@pytest.mark.parametrize("name", VOCABS)
def test_every_reference_case(name):
    path = _models() / f"ggml-vocab-{name}.gguf"
    tok = GGUFTokenizer(_kv(path), str(path))
    cases = _cases(path)
    bad = [(t, ref, got) for t, ref in cases
           if (got := tok.encode(t, add_bos=False, parse_special=False)) != ref]
    assert not bad, f"{len(bad)}/{len(cases)} cases differ, first: {bad[0]!r}"[:800]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unbuildable_tokenizers_are_refused_by_name(name):
    path = _models() / f"ggml-vocab-{name}.gguf"
    with pytest.raises(UnsupportedModelError, match=f"tokenizer model '{REFUSED[name]}'"
                                                    ".*pre-tokenizer") as e:
        GGUFTokenizer(_kv(path), str(path))
    assert str(path) in str(e.value)


def test_spm_round_trip_and_special_tokens():
    path = _models() / "ggml-vocab-llama-spm.gguf"
    tok = GGUFTokenizer(_kv(path), str(path))
    text = "Hello world\n\n  spaces 🦙 ünï"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids[1:]).decode() == " " + text
    s = tok.encode("</s>hi", add_bos=False)
    assert s[0] == tok.eos_id and tok.encode("</s>", add_bos=False, parse_special=False) != [2]
    assert s[1:] == tok.encode("hi", add_bos=False)            # a space prefix after a token


# -- pre-tokenizer splits against llama.cpp's unicode_regex_split -------------------------

_DRIVER = r"""
#include "unicode.h"
#include <iostream>
static std::string rd(std::istream & in) { size_t n; in >> n; in.get(); std::string s(n, '\0');
    in.read(&s[0], n); return s; }
int main() { size_t nr, nt; std::cin >> nr; std::vector<std::string> rx;
    for (size_t i = 0; i < nr; ++i) rx.push_back(rd(std::cin));
    std::cin >> nt;
    for (size_t i = 0; i < nt; ++i) { for (auto & w : unicode_regex_split(rd(std::cin), rx, false))
        std::cout << w.size() << ' ';
        std::cout << '\n'; } }
"""


def _splitter(models: Path) -> Path:
    src = models.parent / "src"
    out = Path(os.environ.get("EXPERTFS_CACHE", Path.home() / ".cache" / "expertfs"))
    exe = out / f"{models.parent.parent.parent.name}-split" / "split"
    if exe.is_file():
        return exe
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler for llama.cpp's unicode splitter")
    exe.parent.mkdir(parents=True, exist_ok=True)
    drv = exe.parent / "driver.cpp"
    drv.write_text(_DRIVER)
    tmp = exe.with_suffix(f".{os.getpid()}")
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{src}", str(drv), str(src / "unicode.cpp"),
                    str(src / "unicode-data.cpp"), "-o", str(tmp)], check=True, timeout=300)
    tmp.replace(exe)
    return exe


def _lc_splits(exe: Path, regexes: tuple[str, ...], texts: list[str]) -> list[list[int]]:
    def field(s: str) -> bytes:
        b = s.encode()
        return f"{len(b)} ".encode() + b
    data = (f"{len(regexes)} ".encode() + b"".join(field(r) for r in regexes)
            + f" {len(texts)} ".encode() + b"".join(field(t) for t in texts))
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True, timeout=60)
    return [[int(x) for x in line.split()] for line in out.stdout.decode().split("\n")[:len(texts)]]


def _ours(regexes: tuple[str, ...], text: str) -> list[int]:
    from tokenizers import Regex, pre_tokenizers
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                   for r in regexes])
    return [len(w.encode()) for w, _ in pre.pre_tokenize_str(text)]


def _lc_regexes(models: Path) -> dict[str, tuple[str, ...]]:
    """``tokenizer.ggml.pre`` → the regexes llama.cpp's src/llama-vocab.cpp gives it."""
    import re
    src = (models.parent / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    src = "\n".join(ln for ln in src.split("\n") if not ln.strip().startswith("//"))
    lit = r'"((?:[^"\\]|\\.)*)"'
    unesc = {"r": "\r", "n": "\n", "t": "\t", "\\": "\\", '"': '"'}
    ctor = src[src.index("struct llm_tokenizer_bpe : llm_tokenizer {"):]
    ctor = ctor[:ctor.index("std::vector<std::string> regex_exprs;")]
    pres = src[src.index("if (tokenizer_pre.empty())"):]
    pres = pres[:pres.index("unknown pre-tokenizer type")]
    out = {}
    for block in re.finditer(r"if \((.*?)\) \{\s*pre_type = (\w+);", pres, re.S):
        case = ctor[ctor.index(f"case {block.group(2)}:"):] if f"case {block.group(2)}:" in ctor \
            else ctor[ctor.index("default:"):]
        body = case[case.index("regex_exprs = {"):case.index("};")]
        rx = tuple(re.sub(r"\\(.)", lambda m: unesc.get(m.group(1), "\\" + m.group(1)), x)
                   for x in re.findall(lit, body))
        for name in re.findall(r'tokenizer_pre == ' + lit, block.group(1)):
            out[name] = rx
    return out


def test_pre_tokenizer_splits_match_llama_cpp():
    models = _models()
    exe = _splitter(models)
    lc = _lc_regexes(models)
    texts = EXTRA + [t for name in VOCABS for t, _ in _cases(models / f"ggml-vocab-{name}.gguf")]
    texts = [t for t in dict.fromkeys(texts) if t]
    seen, bad, checked = set(), [], 0
    for name, (regexes, _, _) in sorted(PRE_SPLITS.items()):
        assert name in lc, f"{name!r} is no pre-tokenizer llama.cpp knows"
        if (regexes, lc[name]) in seen:
            continue
        seen.add((regexes, lc[name]))
        for t, ref in zip(texts, _lc_splits(exe, lc[name], texts)):
            checked += 1
            if _ours(regexes, t) != ref:
                bad.append((name, t))
    assert checked > 500
    assert not bad, f"{len(bad)} splits differ: {sorted({n for n, _ in bad})} e.g. {bad[:4]!r}"[:1500]
