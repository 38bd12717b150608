"""llama.cpp's own converter (``convert_hf_to_gguf.py``) run on a transformers checkpoint.

The reference for names, shapes, types and metadata keys of a new architecture is the converter
that ships with the llama.cpp llama-cpp-python 0.3.36 vendors. This harness finds (or downloads,
``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36``) that source package in a
cache folder (``$EXPERTFS_CACHE`` or ``~/.cache/expertfs``), extracts it once, and runs the
converter in a child process with the package's own ``gguf-py`` first on ``sys.path`` (the
project keeps its pinned ``gguf``). A tiny random model's tokenizer has a pre-tokenizer hash the
converter does not know, so the child patches ``TextModel.get_vocab_base_pre`` to return a known
family name (``vocab_pre``) when the hash is not recognised.

``tiny_bpe_tokenizer(dir, vocab_size, specials)`` writes a byte-level BPE tokenizer (the 256
byte tokens plus named special tokens, e.g. GLM's ``[gMASK]`` / ``<|user|>``) that
``AutoTokenizer.from_pretrained`` loads, so ``save_pretrained`` model folders convert offline.

    python tools/llamacpp_convert.py MODEL_DIR OUT.gguf [--outtype f32] [--vocab-pre glm4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

__all__ = ["VERSION", "ConverterUnavailable", "source_dir", "convert", "tiny_bpe_tokenizer",
           "GLM_SPECIALS"]

VERSION = "0.3.36"
GLM_SPECIALS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                "<|user|>", "<|assistant|>", "<|observation|>")

_CHILD = r"""
import runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [root + "/gguf-py", root]
import conversion.base as base
orig = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        return pre
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


class ConverterUnavailable(RuntimeError):
    """The llama-cpp-python source package is neither cached nor downloadable."""


def _cache_dir(cache: str | os.PathLike | None) -> Path:
    if cache is not None:
        return Path(cache)
    return Path(os.environ.get("EXPERTFS_CACHE", Path.home() / ".cache" / "expertfs"))


def source_dir(cache: str | os.PathLike | None = None) -> Path:
    """``vendor/llama.cpp`` of the extracted llama-cpp-python sdist (downloaded if needed)."""
    base = _cache_dir(cache)
    root = base / f"llama_cpp_python-{VERSION}"
    lc = root / "vendor" / "llama.cpp"
    if (lc / "convert_hf_to_gguf.py").is_file():
        return lc
    tarball = base / f"llama_cpp_python-{VERSION}.tar.gz"
    if not tarball.is_file():
        base.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                            ":all:", f"llama-cpp-python=={VERSION}", "-d", str(base)],
                           capture_output=True, text=True)
        if r.returncode or not tarball.is_file():
            raise ConverterUnavailable(
                f"llama-cpp-python {VERSION} source package not in {base} and pip download "
                f"failed: {(r.stderr or r.stdout).strip()[-300:]}")
    with tarfile.open(tarball) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(
            f"llama_cpp_python-{VERSION}/vendor/llama.cpp/") and ".." not in m.name]
        tf.extractall(base, members=members, filter="data")
    if not (lc / "convert_hf_to_gguf.py").is_file():
        raise ConverterUnavailable(f"{tarball} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return lc


def convert(model_dir: str | os.PathLike, out: str | os.PathLike, *, outtype: str = "f32",
            vocab_pre: str = "glm4", extra: tuple[str, ...] = (),
            cache: str | os.PathLike | None = None, timeout: float = 600) -> Path:
    """Convert the transformers checkpoint in ``model_dir`` to the GGUF ``out``."""
    lc = source_dir(cache)
    env = dict(os.environ, NO_LOCAL_GGUF="1", PYTHONPATH="")
    cmd = [sys.executable, "-c", _CHILD, str(lc), vocab_pre, str(model_dir),
           "--outfile", str(out), "--outtype", outtype, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return Path(out)


def tiny_bpe_tokenizer(out_dir: str | os.PathLike, vocab_size: int,
                       specials: tuple[str, ...] = GLM_SPECIALS) -> None:
    """A byte-level BPE tokenizer (256 byte tokens, no merges, then ``specials``) in
    ``out_dir`` as ``tokenizer.json`` + ``tokenizer_config.json``; ids stay below
    ``vocab_size`` (the converter pads the rest)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    alphabet.sort()
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    if len(vocab) + len(specials) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} < {len(vocab) + len(specials)} tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
           "eos_token": specials[0], "pad_token": specials[0]}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--outtype", default="f32")
    ap.add_argument("--vocab-pre", default="glm4")
    a = ap.parse_args(argv)
    convert(a.model_dir, a.out, outtype=a.outtype, vocab_pre=a.vocab_pre)
    return 0


if __name__ == "__main__":
    sys.exit(main())
