"""Split GGUFs: ``read_model(paths)`` reads a model from one GGUF, from the first shard of a
split one (``NAME-00001-of-0000N.gguf``, its siblings found beside it), or from every shard
listed, checks that the shards' ``split.*`` keys agree and that none is missing or repeated,
and presents the model as one ``GGUFModel``.
"""

from __future__ import annotations

import os
import re

from ..errors import FormatError
from .gguf_read import GGUFFile, GGUFModel, TensorInfo, _bad, read_gguf

__all__ = ["SPLIT_KEYS", "read_model", "shard_paths"]

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_paths(first: str) -> list[str] | None:
    """Sibling shard paths derived from a ``NAME-00001-of-0000N.gguf`` file name, or ``None``."""
    d, base = os.path.split(first)
    m = _SHARD_RE.match(base)
    if not m:
        return None
    count = int(m["count"])
    return [os.path.join(d, f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _split_info(f: GGUFFile) -> tuple[int, int, int] | None:
    if "split.count" not in f.kv:
        return None
    try:
        return int(f.value("split.no")), int(f.value("split.count")), int(f.value("split.tensors.count"))
    except (TypeError, ValueError):
        raise _bad(f.path, "split.* keys are incomplete (split.no, split.count and "
                   "split.tensors.count are all required)") from None


def read_model(paths: list[str] | tuple[str, ...] | str) -> GGUFModel:
    """Read a model from one GGUF, the first shard of a split GGUF, or every shard listed."""
    paths = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    if not paths:
        raise FormatError("no input file given", fix="pass the model's .gguf file")
    first = read_gguf(paths[0])
    info = _split_info(first)
    if info is None or info[1] <= 1:
        if len(paths) > 1:
            raise FormatError(f"{len(paths)} files given but the first is not a split GGUF shard",
                              path=paths[0], fix="pass one model at a time")
        return GGUFModel([first], dict(first.kv), list(first.tensors))
    files = [first] + [read_gguf(p, shard=i + 1) for i, p in enumerate(paths[1:])]
    if len(files) == 1:
        siblings = shard_paths(paths[0])
        if siblings is None:
            raise FormatError(f"is shard {info[0] + 1} of {info[1]} but its name does not follow "
                              "NAME-00001-of-0000N.gguf", path=paths[0],
                              fix="pass every shard on the command line")
        for i, p in enumerate(siblings[1:]):
            if not os.path.exists(p):
                raise FormatError(f"shard {i + 2} of {info[1]} is missing", path=p,
                                  fix="download every shard into the same folder")
            files.append(read_gguf(p, shard=i + 1))
    by_no: dict[int, GGUFFile] = {}
    for f in files:
        si = _split_info(f)
        if si is None or si[1] != info[1] or si[2] != info[2]:
            raise _bad(f.path, "shard's split.* keys disagree with the first shard's",
                       fix="all shards must come from the same split")
        if si[0] in by_no:
            raise FormatError(f"shard number {si[0] + 1} given twice", path=f.path,
                              fix="pass each shard once")
        by_no[si[0]] = f
    missing = [i + 1 for i in range(info[1]) if i not in by_no]
    if missing:
        raise FormatError(f"split model of {info[1]} shards is missing shard(s) {missing}",
                          path=paths[0], fix="pass every shard (or only the first, with its "
                          "siblings in the same folder)")
    ordered = [by_no[i] for i in range(info[1])]
    tensors: list[TensorInfo] = []
    for i, f in enumerate(ordered):
        for t in f.tensors:
            tensors.append(TensorInfo(t.name, t.ne, t.ggml_type, t.offset, t.nbytes, i, t.data_start))
        f.tensors = [t for t in tensors if t.shard == i]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise _bad(ordered[0].path, f"tensor {dup!r} appears in more than one shard")
    if len(tensors) != info[2]:
        raise _bad(ordered[0].path, f"split.tensors.count says {info[2]} tensors but the shards "
                   f"hold {len(tensors)}")
    kv = {k: e for k, e in ordered[0].kv.items() if k not in SPLIT_KEYS}
    return GGUFModel(ordered, kv, tensors)
