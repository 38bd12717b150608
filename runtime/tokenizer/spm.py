"""SentencePiece-style BPE (``tokenizer.ggml.model = "llama"``) as llama.cpp tokenizes it.

llama.cpp (LC ``src/llama-vocab.cpp``, ``llm_tokenizer_spm_session``) splits the text into
UTF-8 characters and repeatedly merges the adjacent pair whose concatenation is the token of the
highest score (``tokenizer.ggml.scores``); a piece that is no token falls back to its bytes
(``<0xXX>`` tokens). Before that, spaces become ``▁`` and each stretch of text between special
tokens gets a leading space when ``tokenizer.ggml.add_space_prefix`` (default true). Here the
same is an HF ``tokenizers`` BPE whose merges are every (left, right) pair of tokens that joins
into a token, ranked by the joined token's score (as transformers converts SentencePiece
vocabularies), with byte fallback; the normalizer prepends ``▁`` to each stretch.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["BYTE", "build_spm", "spm_merges", "spm_token_bytes"]

BYTE = 6                                        # llama.cpp LLAMA_TOKEN_TYPE_BYTE


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two tokens, best joined score first (ties: the
    joined token's id, then the halves' ids)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int]] = []
    for i, piece in enumerate(tokens):
        for k in range(1, len(piece)):
            left, right = vocab.get(piece[:k]), vocab.get(piece[k:])
            if left is not None and right is not None:
                ranked.append((-float(scores[i]), i, left, right))
    ranked.sort()
    return [(tokens[a], tokens[b]) for _, _, a, b in ranked]


def build_spm(tokens: Sequence[str], scores: Sequence[float], *, unk: str | None,
              add_space_prefix: bool) -> Any:
    """The HF ``Tokenizer`` (without added tokens) for an SPM vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), unk_token=unk,
                     byte_fallback=True, fuse_unk=False)
    tok = Tokenizer(bpe)
    norm = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def spm_token_bytes(text: str, token_type: int) -> bytes:
    """The bytes an SPM token stands for: ``<0xXX>`` byte tokens their byte, ``▁`` a space."""
    if token_type == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    return text.replace("▁", " ").encode()
