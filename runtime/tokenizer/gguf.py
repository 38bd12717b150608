"""The tokenizer a GGUF describes, built with HF ``tokenizers``, and its chat template.

Byte-level BPE (``tokenizer.ggml.model = "gpt2"``): the vocabulary is ``tokenizer.ggml.tokens``
(already in GPT-2's byte alphabet), the merges ``tokenizer.ggml.merges``; the pre-tokenizer is
the regex llama.cpp uses for ``tokenizer.ggml.pre`` (``PRE_SPLITS`` in tokenizer_pre.py, from LC
``src/llama-vocab.cpp``: several regexes split in turn), then the byte-level mapping.
SentencePiece BPE (``"llama"``: Mixtral, Phi-3.5-MoE) is built by tokenizer_spm.py. Any other
model, or a pre-tokenizer llama.cpp does not name, is refused naming both. Token
types follow llama.cpp: CONTROL (3) tokens are special (matched in text only when
``parse_special``, dropped when decoding), USER_DEFINED (4) tokens always match whole, UNUSED
(5) padding tokens decode to nothing. BOS is
prepended when ``tokenizer.ggml.add_bos_token`` says so (default per pre-tokenizer, as in
llama.cpp). ``ignore_merges`` (llama3, glm4, tekken): a word that is itself a token is not
split. Chat templates (``tokenizer.chat_template``) render as transformers renders
them (chat.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ...errors import UnsupportedModelError
from .chat import ChatTemplateError, render_chat
from .pre import NO_BOS_PRE, PRE_SPLITS
from .spm import build_spm, spm_token_bytes

__all__ = ["GGUFTokenizer", "PRE_SPLITS", "render_chat"]

UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 2, 3, 4, 5


def _value(kv: Mapping[str, Any], key: str, default: Any = None) -> Any:
    e = kv.get(key)
    return default if e is None else getattr(e, "value", e)


class GGUFTokenizer:
    """``encode(text) -> ids``, ``decode(ids) -> text`` and a streaming ``Detokenizer``."""

    def __init__(self, kv: Mapping[str, Any], path: str | None = None) -> None:
        from tokenizers import AddedToken
        model = _value(kv, "tokenizer.ggml.model")
        tokens = list(_value(kv, "tokenizer.ggml.tokens", []))
        types = [int(t) for t in _value(kv, "tokenizer.ggml.token_type", [1] * len(tokens))]
        self.tokens, self.types, self.spm = tokens, types, model == "llama"
        pre = str(_value(kv, "tokenizer.ggml.pre", "default") or "default")
        if model == "gpt2":
            tok, add_bos_default = _byte_level_bpe(kv, tokens, pre, path)
        elif model == "llama":
            scores = list(_value(kv, "tokenizer.ggml.scores", []))
            if len(scores) != len(tokens):
                raise UnsupportedModelError(
                    f"SPM tokenizer (pre-tokenizer {pre!r}) has {len(scores)} scores for "
                    f"{len(tokens)} tokens", path=path,
                    fix="reconvert the model with llama.cpp's convert_hf_to_gguf.py, or run "
                        "with --tokens instead of a prompt")
            unk_id = _opt_int(kv, "tokenizer.ggml.unknown_token_id")
            tok = build_spm(tokens, scores, unk=None if unk_id is None else tokens[unk_id],
                            add_space_prefix=bool(_value(kv, "tokenizer.ggml.add_space_prefix",
                                                         True)))
            add_bos_default = True
        else:
            raise UnsupportedModelError(
                f"tokenizer model {model!r} (pre-tokenizer {pre!r}) is not supported", path=path,
                fix="byte-level BPE ('gpt2') and SentencePiece ('llama') tokenizers are "
                    "supported; run with --tokens instead of a prompt")
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == USER_DEFINED]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
        self._tok = tok
        self.n_vocab = len(tokens)
        self.bos_id = _opt_int(kv, "tokenizer.ggml.bos_token_id")
        self.eos_id = _opt_int(kv, "tokenizer.ggml.eos_token_id")
        self.eot_id = _opt_int(kv, "tokenizer.ggml.eot_token_id")
        self._special_ids = {n: _opt_int(kv, f"tokenizer.ggml.{k}_token_id") for n, k in (
            ("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("sep", "seperator"),
            ("pad", "padding"), ("cls", "cls"), ("mask", "mask"))}
        if model == "gpt2" and pre in NO_BOS_PRE:
            self.bos_id = None                       # llama.cpp: special_bos_id = NULL
        self.add_bos = bool(_value(kv, "tokenizer.ggml.add_bos_token", add_bos_default))
        self.chat_template = _value(kv, "tokenizer.chat_template")
        self.stop_ids = {i for i in (self.eos_id, self.eot_id) if i is not None}
        self.stop_ids |= {i for i, (t, ty) in enumerate(zip(tokens, types))
                          if ty == CONTROL and t in ("<|im_end|>", "<|endoftext|>", "<|user|>",
                                                     "<|observation|>", "<|return|>", "<|call|>")}
        self._special = {i for i, ty in enumerate(types) if ty in (UNKNOWN, CONTROL)}
        self._unused = {i for i, ty in enumerate(types) if ty == UNUSED}

    def encode(self, text: str, *, add_bos: bool | None = None,
               parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; BOS first when the model adds one (``add_bos=None``)."""
        self._tok.encode_special_tokens = not parse_special
        ids = self._tok.encode(text, add_special_tokens=False).ids
        want_bos = self.add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, special: bool = False,
               keep: frozenset[int] = frozenset()) -> str:
        """Text of ``ids`` as llama.cpp renders it: control and unknown tokens only when
        ``special`` (or listed in ``keep``), unused (padding) tokens never."""
        kept = [int(i) for i in ids if int(i) not in self._unused
                and (special or int(i) not in self._special or int(i) in keep)]
        return self._tok.decode(kept, skip_special_tokens=False)

    def detokenizer(self, keep: frozenset[int] = frozenset()) -> Detokenizer:
        """A streaming decoder; control tokens in ``keep`` are rendered as their text."""
        return Detokenizer(self, keep)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token ``token`` stands for (a control token: its name)."""
        t = self.tokens[int(token)]
        if int(token) in self._special or self.types[int(token)] == USER_DEFINED:
            return t.encode()
        if self.spm:
            return spm_token_bytes(t, self.types[int(token)])
        inv = _byte_decoder()
        return bytes(inv[ch] for ch in t) if all(ch in inv for ch in t) else t.encode()

    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens the GGUF names, as transformers' ``special_tokens_map`` gives
        them to chat templates (``bos_token``, ``eos_token``, ...)."""
        out = {}
        for name, i in self._special_ids.items():
            if i is not None and 0 <= i < len(self.tokens):
                out[f"{name}_token"] = self.tokens[i]
        return out

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """The chat template over ``messages`` (``extra``: ``tools`` and template variables),
        rendered as transformers renders it; a ``ChatTemplateError`` when it refuses them."""
        if not self.chat_template:
            raise ChatTemplateError("the model has no chat template (tokenizer.chat_template), "
                                    "so it cannot take chat messages; give it a plain prompt")
        return render_chat(str(self.chat_template), messages,
                           add_generation_prompt=add_generation_prompt,
                           **{**self.special_tokens_map(), **extra})


class Detokenizer:
    """Incremental decoding: ``push(id)`` returns the new complete text (UTF-8 safe)."""

    def __init__(self, tok: GGUFTokenizer, keep: frozenset[int] = frozenset()) -> None:
        self.tok, self.ids, self.emitted, self.keep = tok, [], "", keep

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tok.decode(self.ids, keep=self.keep)
        if text.endswith("\ufffd"):                 # an unfinished multi-byte character
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new


def _byte_level_bpe(kv: Mapping[str, Any], tokens: list[str], pre: str,
                    path: str | None) -> tuple[Any, bool]:
    """The HF ``Tokenizer`` (without added tokens) for byte-level BPE with llama.cpp's
    pre-tokenizer ``pre``, and whether that pre-tokenizer adds BOS by default."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    if pre not in PRE_SPLITS:
        raise UnsupportedModelError(f"pre-tokenizer {pre!r} is not supported", path=path,
                                    fix="run with --tokens instead of a prompt; known: "
                                        + ", ".join(sorted(PRE_SPLITS)))
    splits, ignore_merges, add_bos_default = PRE_SPLITS[pre]
    merges = [tuple(m.split(" ", 1)) for m in _value(kv, "tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=ignore_merges, byte_fallback=False, fuse_unk=False)
    tok = Tokenizer(bpe)
    try:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    except Exception as e:                      # a regex the regex engine refuses
        raise UnsupportedModelError(f"pre-tokenizer {pre!r} cannot be built: {e}", path=path,
                                    fix="run with --tokens instead of a prompt") from None
    tok.decoder = decoders.ByteLevel()
    return tok, add_bos_default


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character → byte map (the inverse of ``bytes_to_unicode``)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
              + list(range(ord("®"), ord("ÿ") + 1)))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_DECODER


_BYTE_DECODER: dict[str, int] | None = None


def _opt_int(kv: Mapping[str, Any], key: str) -> int | None:
    v = _value(kv, key)
    return None if v is None else int(v)
