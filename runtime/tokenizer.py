"""The tokenizer a GGUF describes, built with HF ``tokenizers``, and its chat template.

Byte-level BPE (``tokenizer.ggml.model = "gpt2"``): the vocabulary is ``tokenizer.ggml.tokens``
(already in GPT-2's byte alphabet), the merges ``tokenizer.ggml.merges``; the pre-tokenizer is
the regex llama.cpp uses for ``tokenizer.ggml.pre`` (``PRE_SPLITS``, from LC
``src/llama-vocab.cpp``: several regexes split in turn), then the byte-level mapping. Token
types follow llama.cpp: CONTROL (3) tokens are special (matched in text only when
``parse_special``, dropped when decoding), USER_DEFINED (4) tokens always match whole, UNUSED
(5) padding tokens decode to nothing. BOS is
prepended when ``tokenizer.ggml.add_bos_token`` says so (default per pre-tokenizer, as in
llama.cpp). ``ignore_merges`` (llama3, glm4, tekken): a word that is itself a token is not
split. Chat templates (``tokenizer.chat_template``) render in a Jinja sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from ..errors import UnsupportedModelError, UsageError

__all__ = ["GGUFTokenizer", "PRE_SPLITS", "render_chat"]

UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 2, 3, 4, 5

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
          r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")

#: ``tokenizer.ggml.pre`` → (regexes applied in turn, ignore_merges, default add_bos)
PRE_SPLITS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (_DEFAULT, False, False),
    **{k: ((_LLAMA3,), True, True) for k in ("llama3", "llama-v3", "llama-bpe", "falcon3",
                                              "falcon-h1", "pixtral", "midm-2.0", "lfm2")},
    **{k: ((_LLAMA3,), False, False) for k in ("dbrx", "smaug-bpe", "chatglm-bpe")},
    **{k: ((_LLAMA3,), True, False) for k in ("glm4", "glm5")},
    **{k: ((_QWEN2,), False, False) for k in ("qwen2", "deepseek-r1-qwen", "stablelm2",
                                              "hunyuan", "grok-2")},
    "qwen35": ((_QWEN35,), False, False),
    **{k: ((_GPT2,), False, False) for k in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
    **{k: ((_GPT4O,), False, False) for k in ("gpt-4o", "minimax-m2", "llama4")},
    "tekken": ((_TEKKEN,), True, True),
    "deepseek-v3": (_DEEPSEEK3, False, False),
}


def _value(kv: Mapping[str, Any], key: str, default: Any = None) -> Any:
    e = kv.get(key)
    return default if e is None else getattr(e, "value", e)


class GGUFTokenizer:
    """``encode(text) -> ids``, ``decode(ids) -> text`` and a streaming ``Detokenizer``."""

    def __init__(self, kv: Mapping[str, Any], path: str | None = None) -> None:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
        model = _value(kv, "tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModelError(f"tokenizer model {model!r} is not supported", path=path,
                                        fix="byte-level BPE ('gpt2') tokenizers are supported; "
                                            "run with --tokens instead of a prompt")
        pre = str(_value(kv, "tokenizer.ggml.pre", "default") or "default")
        if pre not in PRE_SPLITS:
            raise UnsupportedModelError(f"pre-tokenizer {pre!r} is not supported", path=path,
                                        fix="known: " + ", ".join(sorted(PRE_SPLITS)))
        splits, ignore_merges, add_bos_default = PRE_SPLITS[pre]
        tokens = list(_value(kv, "tokenizer.ggml.tokens", []))
        types = [int(t) for t in _value(kv, "tokenizer.ggml.token_type", [1] * len(tokens))]
        merges = [tuple(m.split(" ", 1)) for m in _value(kv, "tokenizer.ggml.merges", [])]
        self.tokens, self.types = tokens, types
        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges,
                         byte_fallback=False, fuse_unk=False)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == USER_DEFINED]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
        self._tok = tok
        self.n_vocab = len(tokens)
        self.bos_id = _opt_int(kv, "tokenizer.ggml.bos_token_id")
        self.eos_id = _opt_int(kv, "tokenizer.ggml.eos_token_id")
        self.eot_id = _opt_int(kv, "tokenizer.ggml.eot_token_id")
        if pre in ("glm4", "glm5", "chatglm-bpe"):
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
        inv = _byte_decoder()
        return bytes(inv[ch] for ch in t) if all(ch in inv for ch in t) else t.encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        if not self.chat_template:
            raise UsageError("the model has no chat template (tokenizer.chat_template)",
                             fix="run without --chat")
        bos = self.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.tokens[self.eos_id] if self.eos_id is not None else ""
        return render_chat(str(self.chat_template), messages, bos_token=bos, eos_token=eos,
                           add_generation_prompt=add_generation_prompt, **extra)


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


def _jsonable(o: Any) -> Any:
    """What ``tojson`` writes for a value ``json`` cannot: a ``map``/``select`` filter's
    generator as a list (templates pipe those into ``tojson``)."""
    if hasattr(o, "__iter__") and not isinstance(o, (str, bytes, dict)):
        return list(o)
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def render_chat(template: str, messages: list[dict[str, str]], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True,
                **extra: Any) -> str:
    """Render a HF-style chat template in a sandboxed Jinja environment."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, default=_jsonable)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, **extra)
    except TemplateError as e:
        raise UsageError(f"the chat template failed: {e}",
                         fix="run without --chat, or fix tokenizer.chat_template") from None
