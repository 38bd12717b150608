"""Corpus and tokenizer for ``train_tiny_moe.py``: Python's own standard library, no downloads.

The corpus is the ``.py`` sources of the running interpreter's standard library (code, comments
and docstrings), without its test suites and the ``encodings`` code-page tables. Files are read in
an order fixed by a hash of their path; a file goes to the held-out split when ``crc32(relative path) % HELD_OUT_MOD == 0``
(about 4% of files), so train and held-out text never share a file. Everything is deterministic
for a given Python build (the meta records the version and a digest of the text used).

The tokenizer is a byte-level BPE trained with HF ``tokenizers`` on the training text, in the
shape llama.cpp loads as ``tokenizer.ggml.model = gpt2`` with ``pre = glm4``: llama.cpp's
CHATGLM4 pre-tokenizer is the llama-3 split regex with ``ignore_merges``, so the HF tokenizer uses
that regex, a byte-level mapping without prefix space, and ``BPE(ignore_merges=True)``; the same
text then gives the same token ids in both. GLM's special tokens come last (token_type CONTROL).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELD_OUT_MOD = 25
# llama.cpp LLAMA_VOCAB_PRE_TYPE_CHATGLM4 / LLAMA3 split (src/llama-vocab.cpp)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GLM-4.5's added tokens (tokenizer_config.json), in their id order
GLM_SPECIALS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                "<|user|>", "<|assistant|>", "<|observation|>")
EOT = "<|endoftext|>"
# GLM-style chat template (the same shape expertfs synth writes for glm4moe)
GLM_TEMPLATE = ("[gMASK]<sop>{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + "
                "message['content'] }}{%- endfor %}{%- if add_generation_prompt %}"
                "{{- '<|assistant|>\\n' }}{%- endif %}")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skip(rel: Path) -> bool:
    parts = rel.parts
    return (parts[0] in ("test", "site-packages", "encodings", "lib2to3", "idlelib")
            or any(p in ("tests", "idle_test", "__pycache__") for p in parts))


def corpus_files() -> tuple[list[Path], list[Path]]:
    """``(train, held_out)`` stdlib source files, split by a hash of the path and ordered by
    another hash of it, so a prefix of either list samples the whole library, not its first
    modules alphabetically."""
    root = stdlib_dir()
    train, held = [], []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if _skip(rel):
            continue
        (held if zlib.crc32(rel.as_posix().encode()) % HELD_OUT_MOD == 0 else train).append(f)
    key = lambda f: (zlib.crc32(b"order:" + f.relative_to(root).as_posix().encode()), f)  # noqa: E731
    return sorted(train, key=key), sorted(held, key=key)


def read_texts(files: list[Path], max_chars: int) -> list[str]:
    """File contents in order until ``max_chars`` (0 = all); unreadable files are skipped."""
    out, n = [], 0
    for f in files:
        try:
            t = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if max_chars and n + len(t) > max_chars:
            t = t[: max_chars - n]
        out.append(t)
        n += len(t)
        if max_chars and n >= max_chars:
            break
    return out


def digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A deterministic byte-level BPE of exactly ``vocab_size`` tokens (GLM specials last)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    n_normal = vocab_size - len(GLM_SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=n_normal, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer, length=len(texts))
    got = tok.get_vocab_size()
    if got != n_normal:
        raise RuntimeError(f"BPE learned {got} tokens, wanted {n_normal}: give it more text "
                           "or a smaller vocabulary")
    tok.add_special_tokens(list(GLM_SPECIALS))
    assert tok.get_vocab_size() == vocab_size
    return tok


def load_tokenizer(path: str | os.PathLike[str]):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.fspath(path))


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    """Token ids of the documents, each followed by ``<|endoftext|>``, as one uint16 stream."""
    eot = tok.token_to_id(EOT)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


@dataclass(frozen=True)
class GGUFVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    ids: dict[str, int]


def gguf_vocab(tok) -> GGUFVocab:
    """What ``convert_hf_to_gguf``'s ``_set_vocab_gpt2`` writes: tokens by id, types, merges."""
    n = tok.get_vocab_size()
    tokens = [tok.id_to_token(i) for i in range(n)]
    if any(t is None for t in tokens):
        raise RuntimeError("token ids are not contiguous")
    special = set(GLM_SPECIALS)
    types = [3 if t in special else 1 for t in tokens]        # CONTROL / NORMAL
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]
    return GGUFVocab(tokens, types, merges, {t: i for i, t in enumerate(tokens)})


@dataclass
class Corpus:
    train: np.ndarray          # uint16 token stream
    held_out: np.ndarray
    meta: dict


def build_corpus(vocab_size: int, max_chars: int, held_chars: int, out_dir: str | None = None):
    """Train the tokenizer on the training text and encode both splits; returns (tok, Corpus)."""
    train_f, held_f = corpus_files()
    train_t = read_texts(train_f, max_chars)
    held_t = read_texts(held_f, held_chars)
    tok = train_tokenizer(train_t, vocab_size)
    if out_dir:
        tok.save(os.path.join(out_dir, "tokenizer.json"))
    c = Corpus(encode_docs(tok, train_t), encode_docs(tok, held_t), {
        "source": "python stdlib .py (no tests, encodings, lib2to3, idlelib)",
        "python": sys.version.split()[0], "stdlib": str(stdlib_dir()),
        "train_files": len(train_t), "held_out_files": len(held_t),
        "train_chars": sum(map(len, train_t)), "held_out_chars": sum(map(len, held_t)),
        "train_digest": digest(train_t), "held_out_digest": digest(held_t)})
    c.meta["train_tokens"], c.meta["held_out_tokens"] = int(len(c.train)), int(len(c.held_out))
    return tok, c
