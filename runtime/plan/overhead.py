"""The runtime's own time per decode step, measured on a real decode: a tiny store of the
planned model's architecture at two depths, decoded by ``runtime.engine.Engine`` with every
expert resident. Its matrices are a few KiB, so its step is the Python and dispatch of the
forward pass: per layer (norms, attention of the architecture's kinds: grouped-query, MLA, KDA,
the DSA indexer, mHC's stream mixing; the router, the expert call, residuals) and per token
(embedding, output head, sampling), the terms ``plan.predict`` adds beside the kernels'
products. An MLA or KDA layer does several times a qwen3moe layer's small operations, so the
probe runs the architecture itself where the caller gives a writer of tiny GGUFs (the CLI
gives ``expertfs synth``'s; the runtime does not depend on the synthesiser), and a tiny
qwen3moe written here otherwise, which the figures' source then says."""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import UsageError
from .geometry import Geometry
from .rates import Range

__all__ = ["TinyWriter", "overhead_kind", "probe_overhead", "source_label", "write_tiny_gguf"]

#: ``writer(path, arch, n_layers, k, period)`` writes a tiny GGUF of ``arch`` with ``n_layers``
#: decoder layers (the same leading dense blocks at any depth), ``k`` experts used a token,
#: and its layer kinds repeating every ``period`` layers as the planned model's do
TinyWriter = Callable[[str, str, int, int, int], None]

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


def overhead_kind(g: Geometry) -> tuple[str, int]:
    """(architecture, period) of ``g``'s decoder layers as the overhead probe builds them: the
    period is how often the layer kinds repeat (glm5-next: an MLA layer every ``period``, KDA
    on the rest), 1 where every layer is alike."""
    if g.arch == "glm5-next" and g.kv_heads:
        mla = sum(1 for h in g.kv_heads if h)
        return g.arch, max(1, round(len(g.kv_heads) / mla)) if mla else 1
    return g.arch, 1


def source_label(source: str) -> str:
    """A figure's source in short: when it was measured, and on which tiny store (so a plan
    says whether its model's own architecture or the tiny qwen3moe set its overhead)."""
    m = re.search(r"a tiny (\S+) store", source)
    head = source.split(":")[0]
    return f"{head}, a tiny {m.group(1)} store" if m else head


def _decode_times(folder: str, n_layers: int, k: int, tokens: int,
                  write: Callable[[str, int], None]) -> list[float]:
    """Per-token decode seconds of a tiny store of ``n_layers`` (after a warm-up)."""
    from ...store.repack import repack
    from ..engine import Engine

    gguf = os.path.join(folder, f"t{n_layers}.gguf")
    store = os.path.join(folder, f"t{n_layers}.efs")
    write(gguf, n_layers)
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
            tok = int(logits.reshape(-1)[:_VOCAB].argmax())
    return out


def _ends(xs: list[float]) -> tuple[float, float]:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.3 * len(s)))], s[0]


def probe_overhead(k: int = 4, tokens: int = 24, arch: str = "qwen3moe", period: int = 1,
                   writer: TinyWriter | None = None) -> tuple[Range, Range, dict[str, Any]]:
    """(seconds per layer, seconds per token beyond the layers, details) of the runtime's
    decode step, through two points: a tiny store of ``arch`` (by ``writer``; without one, a
    tiny qwen3moe) at a shallow and a deep depth, both whole multiples of ``period`` so the
    layers between them mix the kinds as the model does. Slow end from the 30th percentiles,
    fast end from the best steps."""
    k = max(1, min(_EXPERTS, k))
    if writer is None:
        arch, period = "qwen3moe", 1

        def write(path: str, n: int) -> None:
            write_tiny_gguf(path, n, k)
    else:
        def write(path: str, n: int) -> None:
            writer(path, arch, n, k, period)
    lo, hi = (2, 8) if period == 1 else (period, 3 * period)
    with tempfile.TemporaryDirectory(prefix="expertfs-plan-") as d:
        try:
            t_lo = _decode_times(d, lo, k, tokens, write)
        except UsageError:                     # the writer has no tiny model of ``arch``
            if writer is None:
                raise
            return probe_overhead(k, tokens)
        t_hi = _decode_times(d, hi, k, tokens, write)
    (s_lo, f_lo), (s_hi, f_hi) = _ends(t_lo), _ends(t_hi)
    layer_s, layer_f = max(1e-6, (s_hi - s_lo) / (hi - lo)), max(1e-6, (f_hi - f_lo) / (hi - lo))
    tok_s, tok_f = max(0.0, s_lo - lo * layer_s), max(0.0, f_lo - lo * layer_f)
    kinds = f", an MLA layer every {period}" if period > 1 else ""
    src = (f"measured now: decode of a tiny {arch} store at {lo} and {hi} layers{kinds}, top-{k} "
           f"of {_EXPERTS} experts, every expert resident ({tokens} tokens each)")
    detail = {"k": k, "arch": arch, "period": period, f"decode_s_{lo}_layers": t_lo,
              f"decode_s_{hi}_layers": t_hi}
    return (Range(max(layer_s, layer_f), min(layer_s, layer_f), src),
            Range(max(tok_s, tok_f), min(tok_s, tok_f), src), detail)
