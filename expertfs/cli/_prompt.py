"""``expertfs run``'s tokenizer and prompt, read before the engine opens: the prompt's length
bounds the prompt batch the memory budget holds (``_tiers.ram_and_lookahead``)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import UsageError

__all__ = ["tokenized_prompt"]


def tokenized_prompt(args: argparse.Namespace) -> tuple[Any, list[int]]:
    """The store's tokenizer and ``-p``'s text (in the chat template with ``--chat``) as it
    encodes it."""
    from ..runtime.tokenizer.gguf import GGUFTokenizer
    from ..store.reader import Store
    with Store.open(args.store) as st:
        tok = GGUFTokenizer(st.gguf_kv(), st.path)
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}])
    prompt = tok.encode(text)
    if not prompt:
        raise UsageError("the prompt is empty after tokenization", fix="pass some text with -p")
    return tok, prompt
