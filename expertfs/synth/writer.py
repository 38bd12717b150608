"""Write a synthetic model: one GGUF, or a split GGUF in ``NAME-0000k-of-0000N.gguf`` shards.

Splitting follows gguf-py's ``GGUFWriter``: tensors stay in order, a new shard starts when the
next tensor would push the current shard's tensor bytes past the limit, every KV pair goes to
shard 0, and every shard carries ``split.no`` (UINT16), ``split.count`` (UINT16) and
``split.tensors.count`` (INT32), appended after the other keys. A split that comes out as one
shard is written as a plain file, as gguf-py does.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import Callable

from gguf.constants import GGUFValueType

from ..errors import DiskFullError, UsageError
from ..formats.gguf_read import DEFAULT_ALIGNMENT
from ..formats.gguf_write import TensorSpec, encode_kv, pad_to, shard_name, write_gguf
from .config import MAX_LAYERS, SynthConfig
from .data import TensorData
from .model import build_model
from .producer import ChunkProducer

__all__ = ["synthesize", "estimate_bytes", "layers_for_size", "plan_shards", "output_paths"]

log = logging.getLogger(__name__)

_DROP_CACHE_BYTES = 256 << 20    # larger outputs: flush as we go, keep the page cache for others


def estimate_bytes(cfg: SynthConfig) -> int:
    """Exact size of the single-file GGUF ``synthesize(cfg, ...)`` writes."""
    return build_model(cfg).file_bytes


def layers_for_size(cfg: SynthConfig, target_bytes: int) -> SynthConfig:
    """``cfg`` with the most decoder layers whose single-file GGUF fits in ``target_bytes``.

    At least one layer; at most llama.cpp's limit. Layer counts llama.cpp would misread (a
    26/27-layer deepseek2 with q_lora, taken for V2-Lite) are skipped.
    """
    def fits(n: int) -> bool:
        return estimate_bytes(cfg.with_layers(n)) <= target_bytes

    lo, hi = 1, MAX_LAYERS - cfg.n_nextn          # size grows with layers: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    if cfg.arch == "deepseek2" and cfg.q_lora_rank and lo in (26, 27):
        lo = 25
    if lo == 1 and not fits(1):
        log.warning("one layer of %s already takes %d bytes, more than the %d asked for",
                    cfg.name, estimate_bytes(cfg.with_layers(1)), target_bytes)
    return cfg.with_layers(lo).validate()


def plan_shards(specs: list[TensorSpec], max_bytes: int | None) -> list[list[int]]:
    """Tensor indices per shard, gguf-py's rule: start a shard when the next would overflow."""
    if not max_bytes:
        return [list(range(len(specs)))]
    shards: list[list[int]] = [[]]
    used = 0
    for i, s in enumerate(specs):
        if shards[-1] and used + s.nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += s.nbytes
    return shards


def output_paths(out_path: str | os.PathLike[str], n_shards: int) -> list[str]:
    out = os.fspath(out_path)
    if n_shards == 1:
        return [out]
    prefix = out[:-5] if out.endswith(".gguf") else out
    return [shard_name(prefix, i, n_shards) for i in range(n_shards)]


def _split_kv(no: int, count: int, n_tensors: int) -> list[bytes]:
    return [encode_kv("split.no", no, GGUFValueType.UINT16),
            encode_kv("split.count", count, GGUFValueType.UINT16),
            encode_kv("split.tensors.count", n_tensors, GGUFValueType.INT32)]


def _check_space(paths: list[str], need: int) -> None:
    d = os.path.dirname(os.path.abspath(paths[0]))
    if not os.path.isdir(d):
        raise UsageError("output folder does not exist", path=d, fix="create it or pick another -o")
    free = shutil.disk_usage(d).free
    if free < need:
        raise DiskFullError(f"needs {need} bytes but only {free} are free", path=d,
                            fix="free space, pick another folder, or pass a smaller --size/--layers")


def synthesize(cfg: SynthConfig, out_path: str | os.PathLike[str], split_max_bytes: int | None = None,
               progress: Callable[[int, int], None] | None = None, *, overwrite: bool = False,
               drop_cache: bool | None = None, pool_min_bytes: int | None = None) -> list[str]:
    """Write ``cfg``'s model to ``out_path`` (or its shards); returns the paths written.

    ``progress(done, total)`` is called with bytes of tensor data written so far. An existing
    output is an error unless ``overwrite``. ``drop_cache`` (default: outputs over 256 MiB) keeps
    the written pages out of the page cache. ``pool_min_bytes`` is the size from which native
    quant types are tiled from a block pool (see ``data.py``).
    """
    model = build_model(cfg)
    shards = plan_shards(model.specs, split_max_bytes)
    paths = output_paths(out_path, len(shards))
    if not overwrite:
        for p in paths:
            if os.path.exists(p):
                raise UsageError("output exists", path=p, fix="pass --force to overwrite it")
    total = model.data_bytes
    _check_space(paths, model.file_bytes + 4096 * len(shards))
    if drop_cache is None:
        drop_cache = total > _DROP_CACHE_BYTES
    data = TensorData(cfg.seed, pool_min_bytes)
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    for no, (path, idx) in enumerate(zip(paths, shards)):
        kv = list(model.kv) if no == 0 else []
        if len(shards) > 1:
            kv += _split_kv(no, len(shards), len(model.specs))
        specs = [model.specs[i] for i in idx]
        plans = [model.plans[i] for i in idx]
        log.info("writing %s: %d tensors, %d bytes of data", path, len(specs),
                 sum(pad_to(s.nbytes, DEFAULT_ALIGNMENT) for s in specs))
        def make(i: int, plans=plans, specs=specs):      # this shard's lists, bound now
            return data.chunks(plans[i], specs[i].ggml_type)

        with ChunkProducer(len(specs), make) as pf:
            _write(path, kv, specs, lambda i, spec: pf.chunks(i), tick, drop_cache, paths[:no])
    log.info("synthesized %s %s: %d tensors, %s", cfg.arch, cfg.name, len(model.specs),
             model.type_counts())
    return paths


def _write(path: str, kv: list[bytes], specs: list[TensorSpec], chunks, tick, drop_cache: bool,
           written: list[str]) -> None:
    try:
        write_gguf(path, kv, specs, chunks, DEFAULT_ALIGNMENT, tick, drop_cache)
    except BaseException as e:
        for p in written:       # a partial split is useless: remove the shards already written
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise DiskFullError("the disk filled up while writing", path=path,
                                fix="free space or write a smaller model") from None
        raise
