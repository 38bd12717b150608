"""The tokenizer a GGUF describes, as llama.cpp builds it: ``gguf`` (``GGUFTokenizer``: the
vocabulary, the chat template), ``pre`` (the pre-tokenizer splits per ``tokenizer.ggml.pre``),
``spm`` (SentencePiece vocabularies: byte fallback and the space prefix)."""

from .gguf import PRE_SPLITS, GGUFTokenizer, render_chat

__all__ = ["GGUFTokenizer", "PRE_SPLITS", "render_chat"]
