"""A small byte-level BPE vocabulary, learned at synth time, in each architecture's style.

The vocabulary is what ``convert_hf_to_gguf``'s ``_set_vocab_gpt2`` writes for a GPT-2 style
tokenizer (``tokenizer.ggml.model = "gpt2"``):

- 256 byte tokens in GPT-2's ``bytes_to_unicode`` form, in GPT-2's order (printable first);
- up to ``MAX_MERGES`` merges learned deterministically from the Zen of Python (the text of the
  stdlib module ``this``, read from its source so nothing is printed), each adding one token;
- the architecture's special tokens (token_type 3 CONTROL, 4 USER_DEFINED for added non-special
  tokens such as ``<think>``);
- ``[PAD{i}]`` fillers (token_type 5 UNUSED) up to the vocabulary size, as the converter pads.

A family is picked by ``SynthConfig.tokenizer`` (default: the architecture's). The tiny ``llama``
arch gets a byte-level BPE with ``pre = "llama-bpe"`` (as llama.cpp loads Llama 3); the
``Mixtral-8x7B`` preset gets Mixtral's own SentencePiece shape (``tokenizer.ggml.model = "llama"``,
tokenizer_spm.py). ``kimi-k2`` and ``deepseek-llm`` are the byte-level BPE families of Kimi-K2
and DeepSeek-V2 (both ``deepseek2`` in llama.cpp), with their special tokens.
"""

from __future__ import annotations

import ast
import codecs
import importlib.util
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from ..errors import UsageError
from .tokenizer_spm import spm_vocab

__all__ = ["Vocab", "Family", "FAMILIES", "build_vocab", "bytes_to_unicode", "MAX_MERGES", "learn_merges",
           "training_text"]

MAX_MERGES = 400
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5

_CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
           "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
           "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
_GLM = ("[gMASK]<sop>{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + "
        "message['content'] }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}"
        "{%- endif %}")
_MISTRAL = ("{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
            "{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- else %}"
            "{{- message['content'] + eos_token }}{%- endif %}{%- endfor %}")
_DEEPSEEK = ("{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
             "{{- '<｜User｜>' + message['content'] }}{%- elif message['role'] == 'assistant' %}"
             "{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{%- else %}"
             "{{- message['content'] }}{%- endif %}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}")
_KIMI = ("{%- for message in messages %}{{- '<|im_' + message['role'] + '|>' + message['role'] + "
         "'<|im_middle|>' + message['content'] + '<|im_end|>' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}")
_DEEPSEEK_V2 = ("{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
                "{{- 'User: ' + message['content'] + '\\n\\n' }}{%- elif message['role'] == 'assistant' %}"
                "{{- 'Assistant: ' + message['content'] + eos_token }}{%- else %}"
                "{{- message['content'] + '\\n\\n' }}{%- endif %}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- 'Assistant:' }}{%- endif %}")
_HARMONY = ("{%- for message in messages %}{{- '<|start|>' + message['role'] + '<|message|>' + "
            "message['content'] + '<|end|>' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")


@dataclass(frozen=True)
class Family:
    """One architecture's tokenizer style: pre-tokenizer name, special tokens, template."""

    pre: str
    specials: tuple[tuple[str, int], ...]
    eos: str
    bos: str | None = None
    pad: str | None = None
    eot: str | None = None
    add_bos: bool | None = None
    template: str = _CHATML
    model: str = "gpt2"              # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SPM)
    unk: str | None = None


FAMILIES: dict[str, Family] = {
    "qwen3moe": Family("qwen2", (("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL),
                                 ("<|im_end|>", CONTROL), ("<think>", USER_DEFINED),
                                 ("</think>", USER_DEFINED)),
                       eos="<|im_end|>", bos="<|endoftext|>", pad="<|endoftext|>", add_bos=False),
    "glm4moe": Family("glm4", (("<|endoftext|>", CONTROL), ("[MASK]", CONTROL), ("[gMASK]", CONTROL),
                               ("[sMASK]", CONTROL), ("<sop>", CONTROL), ("<eop>", CONTROL),
                               ("<|system|>", CONTROL), ("<|user|>", CONTROL),
                               ("<|assistant|>", CONTROL), ("<|observation|>", CONTROL)),
                      eos="<|endoftext|>", pad="<|endoftext|>", eot="<|user|>", template=_GLM),
    "llama": Family("llama-bpe", (("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL),
                                  ("[INST]", CONTROL), ("[/INST]", CONTROL)),
                    eos="</s>", bos="<s>", add_bos=True, template=_MISTRAL),
    "deepseek2": Family("deepseek-v3", (("<｜begin▁of▁sentence｜>", CONTROL),
                                        ("<｜end▁of▁sentence｜>", CONTROL),
                                        ("<｜User｜>", USER_DEFINED), ("<｜Assistant｜>", USER_DEFINED)),
                        eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
                        pad="<｜end▁of▁sentence｜>", add_bos=True, template=_DEEPSEEK),
    "gpt-oss": Family("gpt-4o", (("<|startoftext|>", CONTROL), ("<|endoftext|>", CONTROL),
                                 ("<|return|>", CONTROL), ("<|constrain|>", CONTROL),
                                 ("<|channel|>", CONTROL), ("<|start|>", CONTROL),
                                 ("<|end|>", CONTROL), ("<|message|>", CONTROL),
                                 ("<|call|>", CONTROL)),
                      eos="<|return|>", bos="<|startoftext|>", pad="<|endoftext|>", template=_HARMONY),
}
_KIMI_SPECIALS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                  "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>",
                  "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                  "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                  "<|im_middle|>", "[UNK]", "[PAD]")
# families a preset names (SynthConfig.tokenizer), beside the per-arch defaults above
FAMILIES.update({
    # moonshotai/Kimi-K2-Instruct tokenizer_config.json: tiktoken BPE, chat turns
    # <|im_{role}|>{role}<|im_middle|>...<|im_end|>, eos <|im_end|>, no BOS added
    "kimi-k2": Family("kimi-k2", tuple((t, CONTROL) for t in _KIMI_SPECIALS), eos="<|im_end|>",
                      bos="[BOS]", pad="[PAD]", add_bos=False, template=_KIMI),
    # deepseek-ai/DeepSeek-V2-Lite-Chat tokenizer_config.json: BOS added, pad = eos,
    # "User: ... Assistant:" turns
    "deepseek-llm": Family("deepseek-llm", (("<｜begin▁of▁sentence｜>", CONTROL),
                                            ("<｜end▁of▁sentence｜>", CONTROL),
                                            ("<｜fim▁hole｜>", USER_DEFINED),
                                            ("<｜fim▁begin｜>", USER_DEFINED),
                                            ("<｜fim▁end｜>", USER_DEFINED)),
                           eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
                           pad="<｜end▁of▁sentence｜>", add_bos=True, template=_DEEPSEEK_V2),
    # mistralai/Mixtral-8x7B-Instruct-v0.1: SentencePiece, <unk> <s> </s> then byte tokens;
    # [INST] is plain text in v0.1
    "mixtral": Family("llama", (("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)),
                      eos="</s>", bos="<s>", add_bos=True, template=_MISTRAL, model="llama",
                      unk="<unk>"),
})
FAMILIES["glm5-next"] = FAMILIES["glm-dsa"] = FAMILIES["glm4moe"]    # _set_vocab_glm, as GLM-4.5


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    family: Family
    scores: tuple[float, ...] = ()

    def id_of(self, token: str | None) -> int | None:
        return None if token is None else self.tokens.index(token)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map (openai/gpt-2 encoder.py)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


@lru_cache(maxsize=1)
def training_text() -> str:
    """The Zen of Python, decoded from the ``this`` module's source (importing it prints)."""
    spec = importlib.util.find_spec("this")
    src = spec.loader.get_source("this") if spec and spec.loader else None
    if not src:
        raise UsageError("the stdlib module 'this' is missing, so no BPE training text",
                         fix="use a complete Python installation")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "s" for t in node.targets):
            return codecs.decode(node.value.value, "rot13")  # type: ignore[attr-defined]
    raise UsageError("the stdlib module 'this' has no text", fix="use a standard CPython")


# GPT-2's pre-tokenizer split, with \p{L} and \p{N} spelled for Python's re
_SPLIT = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+")


@lru_cache(maxsize=8)
def learn_merges(n_merges: int) -> tuple[tuple[str, str], ...]:
    """Byte-level BPE merges: most frequent adjacent pair first, ties broken by the pair."""
    b2u = bytes_to_unicode()
    counts = Counter("".join(b2u[b] for b in w.encode("utf-8")) for w in _SPLIT.findall(training_text()))
    words = [(list(w), c) for w, c in sorted(counts.items())]
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for sym, c in words:
            for a, b in zip(sym, sym[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        joined = best[0] + best[1]
        for sym, _ in words:
            i = 0
            while i < len(sym) - 1:
                if sym[i] == best[0] and sym[i + 1] == best[1]:
                    sym[i:i + 2] = [joined]
                i += 1
    return tuple(merges)


@lru_cache(maxsize=16)
def build_vocab(family: str, n_vocab: int) -> Vocab:
    """The full vocabulary of ``n_vocab`` tokens of a tokenizer family (``FAMILIES``: an
    architecture's default or a preset's)."""
    try:
        fam = FAMILIES[family]
    except KeyError:
        raise UsageError(f"unknown tokenizer family {family!r}",
                         fix=f"use one of {', '.join(FAMILIES)}") from None
    if fam.model == "llama":
        tokens, types, scores = spm_vocab(fam.specials, n_vocab, MAX_MERGES)
        return Vocab(tuple(tokens), tuple(types), (), fam, tuple(scores))
    room = n_vocab - 256 - len(fam.specials)
    if room < 0:
        raise UsageError(f"vocabulary of {n_vocab} tokens cannot hold 256 byte tokens and "
                         f"{len(fam.specials)} special tokens",
                         fix=f"use a vocabulary of at least {256 + len(fam.specials)}")
    tokens = list(bytes_to_unicode().values())   # GPT-2 order: printable bytes first
    seen = set(tokens)
    merges = []
    for a, b in learn_merges(MAX_MERGES):
        if len(tokens) - 256 >= room and a + b not in seen:
            break
        merges.append(f"{a} {b}")
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
    types = [NORMAL] * len(tokens)
    for text, kind in fam.specials:
        tokens.append(text)
        types.append(kind)
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
    return Vocab(tuple(tokens), tuple(types), tuple(merges), fam)
