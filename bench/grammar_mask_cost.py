"""Per-token cost of constrained decoding (``response_format``) on llama.cpp's real vocabularies.

For each ``ggml-vocab-NAME.gguf`` of the llama.cpp sources (found by
``tools/llamacpp_convert.py``'s cache), a ``json_schema`` and a ``json_object`` reply are
decoded from random logits through the server's grammar (``runtime.server.grammar``,
llguidance), and each step's parts are timed: llguidance's mask, its bits unpacked to a bool
mask over the vocabulary, and the mask applied to the logits.

    OMP_NUM_THREADS=1 .venv/bin/python bench/grammar_mask_cost.py qwen2 llama-spm
"""

from __future__ import annotations

import argparse
import statistics as st
import time
from pathlib import Path

import torch

from expertfs.formats.gguf_read import read_gguf
from expertfs.runtime.sampling import Sampler, SamplingParams, allow
from expertfs.runtime.server import grammar
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer

MODELS = Path("/root/.cache/expertfs/llama_cpp_python-0.3.36/vendor/llama.cpp/models")
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False}
FORMATS = ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
           {"type": "json_object"})


def quantiles(xs: list[float]) -> str:
    return f"median {1e3 * st.median(xs):.3f} ms, p90 {1e3 * sorted(xs)[int(.9 * len(xs))]:.3f} ms"


def measure(name: str, seeds: int, steps: int) -> None:
    path = MODELS / f"ggml-vocab-{name}.gguf"
    tok = GGUFTokenizer({k: e.value for k, e in read_gguf(str(path)).kv.items()}, str(path))
    t0 = time.perf_counter()
    grammar._lltokenizer(tok, frozenset())
    build = time.perf_counter() - t0
    for fmt in FORMATS:
        llg, unpack, apply_ = [], [], []
        for seed in range(seeds):
            c = grammar.Constraint(grammar.json_grammar(fmt), tok, frozenset())
            gen = torch.Generator().manual_seed(seed)
            smp = Sampler(SamplingParams(0.0))
            for _ in range(steps):
                lg = torch.randn(tok.n_vocab, generator=gen) * 3
                t0 = time.perf_counter()
                c.m.compute_bitmask()
                t1 = time.perf_counter()
                mask = c.allowed()
                t2 = time.perf_counter()
                lg2 = allow(lg, mask)
                t3 = time.perf_counter()
                llg.append(t1 - t0)
                unpack.append(t2 - t1 - (t1 - t0))
                apply_.append(t3 - t2)
                t = smp(lg2)
                if t in tok.stop_ids:
                    break
                c.consume(t)
                if c.done:
                    break
        print(f"{name} ({tok.n_vocab} tokens; llguidance view built in {build * 1e3:.0f} ms) "
              f"{fmt['type']}, {len(llg)} steps: llguidance mask {quantiles(llg)}; "
              f"bits->bool {quantiles(unpack)}; apply {quantiles(apply_)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vocab", nargs="+", help="llama.cpp vocabulary names (qwen2, llama-spm, ...)")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    for name in a.vocab:
        measure(name, a.seeds, a.steps)


if __name__ == "__main__":
    main()
