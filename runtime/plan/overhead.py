"""The runtime's own time per decode step, measured on a real decode: a tiny qwen3moe store
(random ggml blocks from ``formats.random_blocks``, written with ``formats.gguf_write`` and
repacked into a temporary folder) at two depths, decoded by ``runtime.engine.Engine`` with
every expert resident. Its matrices are a few KiB, so its step is the Python and dispatch
of the forward pass: per layer (norms, attention, router, the expert call, residuals) and
per token (embedding, output head, sampling), the terms ``plan.predict`` adds beside the
kernels' products."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import numpy as np

from .rates import Range

__all__ = ["probe_overhead", "write_tiny_gguf"]

_EMBD, _FF, _HEADS, _KV_HEADS, _HD, _VOCAB, _EXPERTS = 256, 256, 4, 2, 64, 512, 8


def write_tiny_gguf(path: str, n_layers: int, k: int, seed: int = 0) -> None:
    """A qwen3moe GGUF of ``n_layers`` blocks, 8 experts of which ``k`` are used, Q4_K
    matrices (Q6_K down), F32 norms and routers; random weights."""
    from ...formats.ggml import GGMLType, block_size, type_size
    from ...formats.gguf_write import TensorSpec, encode_kv, write_gguf
    from ...formats.random_blocks import make_blocks

    a = "qwen3moe"
    kv = [encode_kv("general.architecture", a), encode_kv("general.name", "plan overhead probe"),
          encode_kv("general.alignment", 32)]
    for key, v in (("block_count", n_layers), ("context_length", 4096), ("embedding_length", _EMBD),
                   ("feed_forward_length", 2 * _FF), ("attention.head_count", _HEADS),
                   ("attention.head_count_kv", _KV_HEADS), ("rope.freq_base", 1e6),
                   ("attention.layer_norm_rms_epsilon", 1e-6), ("expert_count", _EXPERTS),
                   ("expert_used_count", k), ("attention.key_length", _HD),
                   ("attention.value_length", _HD), ("expert_feed_forward_length", _FF),
                   ("vocab_size", _VOCAB)):
        kv.append(encode_kv(f"{a}.{key}", v))
    q4, q6, f32 = GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F32
    specs = [TensorSpec("token_embd.weight", (_EMBD, _VOCAB), q4),
             TensorSpec("output_norm.weight", (_EMBD,), f32),
             TensorSpec("output.weight", (_EMBD, _VOCAB), q6)]
    for i in range(n_layers):
        b = f"blk.{i}."
        specs += [TensorSpec(b + "attn_norm.weight", (_EMBD,), f32),
                  TensorSpec(b + "attn_q.weight", (_EMBD, _HEADS * _HD), q4),
                  TensorSpec(b + "attn_k.weight", (_EMBD, _KV_HEADS * _HD), q4),
                  TensorSpec(b + "attn_v.weight", (_EMBD, _KV_HEADS * _HD), q4),
                  TensorSpec(b + "attn_output.weight", (_HEADS * _HD, _EMBD), q4),
                  TensorSpec(b + "attn_q_norm.weight", (_HD,), f32),
                  TensorSpec(b + "attn_k_norm.weight", (_HD,), f32),
                  TensorSpec(b + "ffn_norm.weight", (_EMBD,), f32),
                  TensorSpec(b + "ffn_gate_inp.weight", (_EMBD, _EXPERTS), f32),
                  TensorSpec(b + "ffn_gate_exps.weight", (_EMBD, _FF, _EXPERTS), q4),
                  TensorSpec(b + "ffn_up_exps.weight", (_EMBD, _FF, _EXPERTS), q4),
                  TensorSpec(b + "ffn_down_exps.weight", (_FF, _EMBD, _EXPERTS), q6)]
    rng = np.random.default_rng(seed)

    def chunks(i: int, spec: TensorSpec):
        n = int(np.prod(spec.ne))
        if spec.ggml_type == f32:
            norm = spec.name.endswith("norm.weight")
            yield (np.ones(n, np.float32) if norm else
                   rng.standard_normal(n).astype(np.float32) * 0.1)
            return
        t = spec.ggml_type
        blocks = make_blocks(t, n // block_size(t), spec.ne[0] ** -0.5, rng)
        yield np.ascontiguousarray(blocks).view(np.uint8).reshape(-1)[: n // block_size(t) * type_size(t)]

    write_gguf(path, kv, specs, chunks, alignment=32)


def _decode_times(folder: str, n_layers: int, k: int, tokens: int) -> list[float]:
    """Per-token decode seconds of a tiny store of ``n_layers`` (after a warm-up)."""
    from ...store.repack import repack
    from ..engine import Engine

    gguf = os.path.join(folder, f"t{n_layers}.gguf")
    store = os.path.join(folder, f"t{n_layers}.efs")
    write_tiny_gguf(gguf, n_layers, k)
    repack(gguf, store)
    os.unlink(gguf)
    with Engine.open(store, ram_bytes=256 << 20, n_ctx=256,
                     provider_options={"warm_start": False}) as eng:
        eng.prefill([1, 2, 3, 4])
        tok, out = 5, []
        for i in range(tokens + 4):
            t0 = time.perf_counter()
            logits = eng.decode(tok)
            if i >= 4:
                out.append(time.perf_counter() - t0)
            tok = int(logits.argmax()) % _VOCAB
    return out


def _ends(xs: list[float]) -> tuple[float, float]:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.3 * len(s)))], s[0]


def probe_overhead(k: int = 4, tokens: int = 24) -> tuple[Range, Range, dict[str, Any]]:
    """(seconds per layer, seconds per token beyond the layers, details) of the runtime's
    decode step, through two points: a 2-layer and an 8-layer tiny store. Slow end from the
    30th percentiles, fast end from the best steps."""
    k = max(1, min(_EXPERTS, k))
    with tempfile.TemporaryDirectory(prefix="expertfs-plan-") as d:
        t2 = _decode_times(d, 2, k, tokens)
        t8 = _decode_times(d, 8, k, tokens)
    (s2, f2), (s8, f8) = _ends(t2), _ends(t8)
    layer_s, layer_f = max(1e-6, (s8 - s2) / 6), max(1e-6, (f8 - f2) / 6)
    tok_s, tok_f = max(0.0, s2 - 2 * layer_s), max(0.0, f2 - 2 * layer_f)
    src = (f"measured now: decode of a tiny qwen3moe store at 2 and 8 layers, top-{k} of "
           f"{_EXPERTS} experts, every expert resident ({tokens} tokens each)")
    detail = {"k": k, "decode_s_2_layers": t2, "decode_s_8_layers": t8}
    return (Range(max(layer_s, layer_f), min(layer_s, layer_f), src),
            Range(max(tok_s, tok_f), min(tok_s, tok_f), src), detail)
