"""llama.cpp's pre-tokenizers for byte-level BPE, per ``tokenizer.ggml.pre``.

Each name maps to the regexes llama.cpp's ``llm_tokenizer_bpe`` applies in turn (LC
``src/llama-vocab.cpp``; every regex splits the pieces the one before left), whether merges are
ignored for a word that is itself a token, and whether BOS is added by default. Where llama.cpp
runs a hand-written splitter instead of its regex (``src/unicode.cpp``: ``kimi-k2``), the regex
here is written to split as that code does, not as the model's own tokenizer regex reads.
"""

from __future__ import annotations

__all__ = ["PRE_SPLITS", "NO_BOS_PRE"]

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# gpt-4o, tekken: llama.cpp's adapted forms, where a letter outside ASCII counts as both upper
# and lower case and a combining mark as no letter (LC runs them on category-collapsed text)
_UP, _LO = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*"
          rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
# deepseek-llm/-coder: llama.cpp matches these with std::wregex on a text whose non-ASCII white
# space became U+000B, so no class here matches white space (U+3000 and kin are not "CJK")
_CIJK = "[[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]&&[^\\s]]+"
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3001-\u3002]+",
    "\\s+$",
    _CIJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CIJK, r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)
# unicode_cpt_is_han (LC src/unicode.cpp): the code points kimi-k2's splitter calls Han
_HAN = ("\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f"
        "\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\U0002ceb0-\U0002ebef\uf900-\ufaff"
        "\U0002f800-\U0002fa1f")
# unicode_regex_split_custom_kimi_k2: Han runs; one optional non-letter/number lead and a run
# of (non-Han) letters of any case, then an optional contraction; digits in threes; then llama3
_KIMI_K2 = (f"[{_HAN}]+|[^\\r\\n\\p{{L}}\\p{{N}}]?[\\p{{L}}&&[^{_HAN}]]+{_CONTRACTIONS}?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
_EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

#: ``tokenizer.ggml.pre`` → (regexes applied in turn, ignore_merges, default add_bos)
PRE_SPLITS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (_DEFAULT, False, False),
    **{k: ((_LLAMA3,), True, True) for k in ("llama3", "llama-v3", "llama-bpe", "falcon3",
                                              "falcon-h1", "pixtral", "midm-2.0", "lfm2")},
    **{k: ((_LLAMA3,), False, False) for k in ("dbrx", "smaug-bpe", "chatglm-bpe")},
    **{k: ((_LLAMA3,), True, False) for k in ("glm4", "glm5")},
    **{k: ((_QWEN2,), False, False) for k in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez",
                                              "hunyuan", "grok-2", "solar-open")},
    "qwen35": ((_QWEN35,), False, False),
    **{k: ((_GPT2,), False, False) for k in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4",
                                             "trillion")},
    **{k: ((_GPT4O,), False, False) for k in ("gpt-4o", "minimax-m2", "llama4")},
    "tekken": ((_TEKKEN,), True, True),
    **{k: (_DEEPSEEK3, False, False) for k in ("deepseek-v3", "hunyuan-dense", "joyai-llm",
                                                "hy_v4")},
    "deepseek-llm": (_DEEPSEEK_LLM, False, False),
    "deepseek-coder": (_DEEPSEEK_CODER, False, False),
    "kimi-k2": ((_KIMI_K2,), False, False),
    "falcon": (_FALCON, False, False),
    **{k: (_STARCODER, False, False) for k in ("starcoder", "refact", "command-r", "smollm",
                                                "codeshell", "exaone", "minerva-7b")},
    **{k: ((_BAILINGMOE,), False, False) for k in ("bailingmoe", "bailingmoe2", "llada-moe")},
    "exaone-moe": ((_EXAONE_MOE,), False, False),
    "seed-coder": ((_SEED_CODER,), False, False),
}

#: pre-tokenizers for which llama.cpp drops the BOS token (``special_bos_id = NULL``)
NO_BOS_PRE = frozenset({"glm4", "glm5", "chatglm-bpe"})
