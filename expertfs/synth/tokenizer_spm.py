"""A small SentencePiece vocabulary (``tokenizer.ggml.model = "llama"``), learned at synth time.

Laid out as ``convert_hf_to_gguf``'s ``_set_vocab_sentencepiece`` writes Mixtral's: the
family's special tokens first (``<unk>`` UNKNOWN, ``<s>`` / ``</s>`` CONTROL), then the 256
byte-fallback tokens ``<0x00>``..``<0xFF>`` (token_type 6 BYTE), then pieces by falling score:
merged pieces learned from the Zen of Python (spaces as ``▁``, each word with its leading
``▁``), then the single characters they are made of; ``[PAD{i}]`` fillers (UNUSED, score
-1000) up to the vocabulary size. A piece's score ranks it as SentencePiece's BPE ranks merges,
so llama.cpp's SPM tokenizer (highest-scoring pair first) follows the learned merges.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from ..errors import UsageError

__all__ = ["BYTE", "SPACE", "learn_pieces", "spm_vocab"]

BYTE = 6
SPACE = "\u2581"
_NORMAL, _UNUSED = 1, 5


@lru_cache(maxsize=4)
def learn_pieces(n_merges: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(merged pieces in merge order, single characters by falling frequency)``."""
    from .tokenizer import training_text
    counts = Counter(SPACE + w for w in training_text().split())
    chars = Counter()
    for w, c in counts.items():
        for ch in w:
            chars[ch] += c
    alphabet = tuple(ch for ch, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0])))
    words = [(list(w), c) for w, c in sorted(counts.items())]
    merged: list[str] = []
    while len(merged) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for sym, c in words:
            for a, b in zip(sym, sym[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        a, b = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        joined = a + b
        merged.append(joined)
        for sym, _ in words:
            i = 0
            while i < len(sym) - 1:
                if sym[i] == a and sym[i + 1] == b:
                    sym[i:i + 2] = [joined]
                i += 1
    return tuple(merged), alphabet


def spm_vocab(specials: tuple[tuple[str, int], ...], n_vocab: int,
              n_merges: int) -> tuple[list[str], list[int], list[float]]:
    """``(tokens, token types, scores)`` of an ``n_vocab``-token SPM vocabulary."""
    merged, alphabet = learn_pieces(n_merges)
    fixed = len(specials) + 256 + len(alphabet)
    if n_vocab < fixed:
        raise UsageError(f"vocabulary of {n_vocab} tokens cannot hold {len(specials)} special "
                         f"tokens, 256 byte tokens and {len(alphabet)} characters",
                         fix=f"use a vocabulary of at least {fixed}")
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in specials] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = [p for p in merged if p not in alphabet][:n_vocab - fixed] + list(alphabet)
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(_NORMAL)
        scores.append(-float(rank))
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(_UNUSED)
        scores.append(-1000.0)
    return tokens, types, scores
