"""Reference GGUFs from llama.cpp's own converter, for synth's name/shape/key comparison.

A tiny random transformers model of an architecture is built from a geometry (seeded), saved with
``save_pretrained`` (which writes the original checkpoint layout: per-expert tensors, split conv1d,
``hc_attn_fn``...), given the config keys the converter reads that transformers does not keep
(``linear_attn_config``, ``mla_use_nope``, ``first_k_dense_replace``, ``num_nextn_predict_layers``),
a NextN block (the real checkpoints carry one; transformers does not model it) and a small GLM
tokenizer. ``convert_hf_to_gguf.py`` then runs in a child process with the vendored ``gguf-py``
first on ``sys.path`` and ``get_vocab_base_pre`` patched to ``glm4`` (the tiny tokenizer's hash is
unknown to it), by tools/llamacpp_convert.py. The result is read back with expertfs's own GGUF
reader.
"""

from __future__ import annotations

import json
from pathlib import Path

from llamacpp_convert import ConverterUnavailable, source_dir
from llamacpp_convert import convert as convert_hf

__all__ = ["llamacpp_dir", "build_glm5_next", "build_glm_dsa", "convert", "read_layout"]

_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
             "<|user|>", "<|assistant|>", "<|observation|>"]


def llamacpp_dir() -> Path | None:
    """The vendored llama.cpp of llama-cpp-python 0.3.36 (downloaded into the cache if needed by
    tools/llamacpp_convert.py), or None when it cannot be had."""
    try:
        return source_dir()
    except ConverterUnavailable:
        return None


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from expertfs.synth.tokenizer import bytes_to_unicode
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": _SPECIALS[1:]})
    fast.save_pretrained(out)


def _nextn(sd: dict, src: int, dst: int, hidden: int, seed: int) -> dict:
    """A NextN block ``dst``: a copy of layer ``src`` (without its mHC tensors) plus the NextN
    wiring, as GLM checkpoints name it."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        pre = f"model.layers.{src}."
        if k.startswith(pre) and ".hc_" not in k:
            out[f"model.layers.{dst}." + k[len(pre):]] = v.clone()
    p = f"model.layers.{dst}."
    out[p + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.05
    for n in ("enorm", "hnorm", "shared_head.norm"):
        out[p + n + ".weight"] = torch.ones(hidden)
    return out


def _save(model, cfg_extra: dict, out: Path, n_layers: int, hidden: int, src_layer: int,
          text_key: str | None) -> None:
    from safetensors.torch import load_file, save_file
    model.save_pretrained(out)
    st = out / "model.safetensors"
    sd = load_file(st)
    prefix = "model.language_model." if text_key else "model."
    sd = {k.replace(prefix, "model."): v for k, v in sd.items()}
    sd.update(_nextn(sd, src_layer, n_layers, hidden, 7))
    save_file({k: v.contiguous() for k, v in sd.items()}, st, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (cfg[text_key] if text_key else cfg).update(cfg_extra)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    _tokenizer(out)


def build_glm5_next(out: Path, g: dict, seed: int = 0) -> None:
    """A tiny ``Glm5NextForConditionalGeneration`` (1-block vision tower, skipped by the
    converter) with geometry ``g`` (transformers text-config field names)."""
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    torch.manual_seed(seed)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32,
                  out_hidden_size=g["hidden_size"], projection_intermediate_size=32)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=dict(g), vision_config=vision))
    dense = g["mlp_layer_types"].count("dense")
    extra = dict(first_k_dense_replace=dense, num_nextn_predict_layers=1, mla_use_nope=True,
                 linear_attn_config=dict(num_heads=g["linear_num_heads"],
                                         head_dim=g["linear_head_dim"],
                                         short_conv_kernel_size=g.get("linear_conv_kernel_dim", 4),
                                         gate_lower_bound=g.get("linear_lower_bound", -5.0)))
    src = max(i for i, t in enumerate(g["layer_types"]) if t != "linear_attention"
              and g["indexer_types"][i] == "full")
    _save(model, extra, out, g["num_hidden_layers"], g["hidden_size"], src, "text_config")


def build_glm_dsa(out: Path, g: dict, seed: int = 0) -> None:
    """A tiny ``GlmMoeDsaForCausalLM`` with geometry ``g``, plus its NextN block."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**g))
    src = max(i for i, t in enumerate(g["indexer_types"]) if t == "full")
    _save(model, dict(num_nextn_predict_layers=1), out, g["num_hidden_layers"], g["hidden_size"],
          src, None)


def convert(model_dir: Path, out: Path, outtype: str = "q8_0") -> Path:
    """Run llama.cpp's converter on ``model_dir`` (tools/llamacpp_convert.py); the GGUF path."""
    return convert_hf(model_dir, out, outtype=outtype)


def read_layout(path: Path) -> tuple[list[tuple[str, tuple[int, ...], str]], dict]:
    """``[(name, ggml ne, type name)]`` in file order and ``{key: KVEntry}`` of a GGUF."""
    from expertfs.formats.gguf_read import read_gguf
    f = read_gguf(str(path))
    return [(t.name, tuple(t.ne), t.ggml_type.name) for t in f.tensors], dict(f.kv)
