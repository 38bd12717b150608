"""Small MoE GGUFs written with gguf-py's own GGUFWriter (not ours), for store tests.

These are independent of ``expertfs.synth`` on purpose: the store is checked against files
written by llama.cpp's writer. Shapes are tiny; names and metadata follow llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

QUANTISABLE = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4)


def _q(rng: np.random.Generator, shape: tuple[int, ...], qt: T) -> tuple[np.ndarray, T | None]:
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    if qt == T.F32:
        return w, None
    if qt == T.F16:
        return w.astype(np.float16), None
    return quants.quantize(w, qt), qt


def moe_gguf(path: str | Path, *, arch: str = "qwen3moe", layers: int = 2, experts: int = 4,
             hidden: int = 64, ff: int = 32, types: tuple[T, T, T] = (T.Q8_0, T.Q8_0, T.Q8_0),
             fused: bool = False, biases: bool = False, nextn: int = 0, dense: bool = False,
             alignment: int | None = None, split_max_tensors: int = 0, seed: int = 0) -> list[Path]:
    """Write a tiny MoE (or, with ``dense``, a dense) GGUF; returns the file(s) written."""
    rng = np.random.default_rng(seed)
    path = Path(path)
    wr = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    blocks = layers + nextn
    wr.add_block_count(blocks)
    wr.add_embedding_length(hidden)
    wr.add_name(f"tiny {arch}")
    if not dense:
        wr.add_expert_count(experts)
        wr.add_expert_used_count(2)
        wr.add_expert_feed_forward_length(ff)
    if nextn:
        wr.add_uint32(f"{arch}.nextn_predict_layers", nextn)
    wr.add_token_list([f"t{i}" for i in range(16)])
    if alignment:
        wr.add_custom_alignment(alignment)
    wr.add_tensor("token_embd.weight", *_q(rng, (16, hidden), T.F32)[:1])
    for b in range(blocks):
        wr.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(hidden, np.float32))
        a, t = _q(rng, (hidden, hidden), T.Q8_0)
        wr.add_tensor(f"blk.{b}.attn_q.weight", a, raw_dtype=t)
        if dense:
            for n, shape in (("gate", (ff, hidden)), ("up", (ff, hidden)), ("down", (hidden, ff))):
                wr.add_tensor(f"blk.{b}.ffn_{n}.weight", *_q(rng, shape, T.F32)[:1])
            continue
        wr.add_tensor(f"blk.{b}.ffn_gate_inp.weight", _q(rng, (experts, hidden), T.F32)[0])
        roles = [("gate_up", (experts, 2 * ff, hidden), types[0])] if fused else \
            [("gate", (experts, ff, hidden), types[0]), ("up", (experts, ff, hidden), types[1])]
        for n, shape, qt in roles + [("down", (experts, hidden, ff), types[2])]:
            a, t = _q(rng, shape, qt)
            wr.add_tensor(f"blk.{b}.ffn_{n}_exps.weight", a, raw_dtype=t)
        if biases:
            for n, width in (("gate", ff), ("up", ff), ("down", hidden)):
                wr.add_tensor(f"blk.{b}.ffn_{n}_exps.bias", _q(rng, (experts, width), T.F32)[0])
        if nextn and b >= layers:
            wr.add_tensor(f"blk.{b}.nextn.eh_proj.weight", _q(rng, (hidden, 2 * hidden), T.F32)[0])
    wr.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return [Path(p) for p in wr.format_shard_names(path)]
