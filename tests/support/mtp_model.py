"""Fixtures shared by the MTP tests: a glm4moe with a NextN block, built in seconds.

``build_model(out)`` makes ``tools/train_tiny_moe_model.TinyGlmMoe`` (transformers' Glm4Moe
plus transformers' own ``MtpLayer`` NextN block, the training script's model) with seeded
unit-scale weights (so logits and routes have no near-ties), exports it with
``tools/export_glm4moe_gguf.export`` (llama.cpp's names, NextN block included, float32) and
repacks it. The torch model is the independent reference. No training: correctness checks do
not need a model that has learned anything (acceptance is measured in bench/bench_mtp.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")



@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread while a module runs (two spin against each other on a shared box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build_model(out: Path, *, seed: int = 0, dtype: str = "F32", **over):
    """(torch model, gguf path, store path) of a random tiny glm4moe + NextN under ``out``."""
    import export_glm4moe_gguf as ex
    import train_tiny_moe_data as data
    from train_tiny_moe_model import TinyGlmMoe, preset, save_checkpoint

    from expertfs.store.repack import repack
    p = preset("tiny", **over)
    model = TinyGlmMoe(p, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.dtype.is_floating_point or "inv_freq" in name:
                continue
            r = torch.randn(t.shape, generator=g)
            if "norm" in name:
                t.copy_(1.0 + 0.1 * r)
            elif "bias" in name:
                t.copy_(0.1 * r)
            elif "embed_tokens" in name:
                t.copy_(r)
            elif t.dim() >= 2:
                t.copy_(r / math.sqrt(t.shape[-1]))
    model.eval()
    run = out / "run"
    run.mkdir(parents=True, exist_ok=True)
    save_checkpoint(str(run / "model.pt"), model, {"seed": seed})
    train, _ = data.corpus_files()
    tok = data.train_tokenizer(data.read_texts(train[:40], 150_000), p.vocab)
    tok.save(str(run / "tokenizer.json"))
    gguf = out / "model.gguf"
    ex.export(str(run), str(gguf), experts=dtype, matrices=dtype)
    store = out / "model.efs"
    repack([str(gguf)], str(store), force=True)
    return model, gguf, store


MTP_OPTIONS = ("mtp", "mtp_max", "draft_prefetch", "route_tail_skip")


class Opened:
    """An open engine and what ``runtime.mtp.attach`` built on it (None: nothing asked for);
    ``with`` gives the pair and closes the engine."""

    def __init__(self, eng, sp) -> None:
        self.eng, self.sp = eng, sp

    def __enter__(self):
        return self.eng, self.sp

    def __exit__(self, *exc) -> None:
        self.eng.close()


def engine(store: Path, **opts) -> Opened:
    """Open ``store`` with the engine and MTP options among ``opts`` (fused off by default)."""
    from expertfs.runtime.engine import Engine, EngineOptions
    from expertfs.runtime.mtp import MTPOptions, attach
    opts.setdefault("fused", "off")
    provider = opts.pop("provider", "direct")
    ram = opts.pop("ram_bytes", 0)
    mtp = MTPOptions(**{k: opts.pop(k) for k in MTP_OPTIONS if k in opts})
    eng = Engine.open(str(store), provider=provider, ram_bytes=ram,
                      options=mtp.engine_options(EngineOptions(**opts)))
    try:
        return Opened(eng, attach(eng, mtp))
    except BaseException:
        eng.close()
        raise


def stats(eng, sp) -> dict:
    """``eng.stats()`` with the speculation's figures, as the CLI prints them."""
    return {**eng.stats(), **(sp.report() if sp is not None else {})}


def greedy_plain(eng, prompt: list[int], n: int) -> list[int]:
    from expertfs.runtime.sampling import Sampler
    s = Sampler()
    out = [s(eng.prefill(prompt))]
    while len(out) < n:
        out.append(s(eng.decode(out[-1])))
    return out
