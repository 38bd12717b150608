"""``repack``: GGUF → store, crash-safe and resumable.

The store is built in ``OUT.partial/`` and appears at ``OUT`` by one atomic rename once every
byte is written, synced and indexed. Progress is checkpointed in the partial index (data
synced first, then one LMDB transaction with the finished records and the resume point), so a
repack killed at any moment leaves either no store or a complete one, and running it again
resumes from the last checkpoint when the sources and options are unchanged (and restarts
cleanly when they are not). A full disk removes the partial store and says so.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

import lmdb
import xxhash
import zstandard

from ..errors import DiskFullError, ExpertfsError, UsageError
from ..formats.gguf_read import GGUFModel
from ..formats.gguf_split import read_model
from .index import Index
from .layout import (EXPERTS_FILE, FORMAT_VERSION, INDEX_DIR, KIND_EXPERT, TRUNK_FILE,
                     TensorRecord)
from ..formats.moe_names import layer_of
from .plan import RepackPlan, plan_repack
from .summary import model_summary
from .windows import DEFAULT_WINDOW, Window, window_capacity, windows
from .writer import Completed, WindowWriter, is_disk_full, open_output, write_error

__all__ = ["repack", "RepackResult", "PARTIAL_SUFFIX", "encode_kv_blob", "CHECKPOINT_BYTES"]

log = logging.getLogger(__name__)
PARTIAL_SUFFIX = ".partial"
CHECKPOINT_BYTES = 256 << 20
_LOCK = ".lock"


@dataclass
class RepackResult:
    store: str
    resumed_from_bytes: int
    bytes_copied: int
    seconds: float
    direct_io: bool
    summary: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"store": self.store, "resumed_from_bytes": self.resumed_from_bytes,
                "bytes_copied": self.bytes_copied, "seconds": round(self.seconds, 3),
                "direct_io": self.direct_io,
                "bytes_per_second": self.bytes_copied / self.seconds if self.seconds else None,
                **{k: v for k, v in self.summary.items() if k != "layers"}}


def encode_kv_blob(model: GGUFModel) -> bytes:
    """The model's metadata exactly as GGUF encodes it (split.* keys dropped), zstd-compressed."""
    raw = struct.pack("<Q", len(model.kv)) + b"".join(e.raw for e in model.kv.values())
    return zstandard.ZstdCompressor(level=3).compress(raw)


def _fingerprint(model: GGUFModel, alignment: int, window_bytes: int) -> str:
    h = xxhash.xxh3_128()
    h.update(json.dumps([FORMAT_VERSION, alignment, window_bytes]).encode())
    for s in model.shards:
        st = os.stat(s.path)
        h.update(struct.pack("<QQ", st.st_size, st.st_mtime_ns))
        with open(s.path, "rb") as f:
            h.update(f.read(s.data_offset))
    return h.hexdigest()


def _check_output(out: str, model: GGUFModel, force: bool) -> None:
    real = os.path.realpath(out)
    for p in model.paths:
        rp = os.path.realpath(p)
        if rp == real or rp.startswith(real + os.sep):
            raise UsageError("the output would overwrite the model being repacked", path=out,
                             fix="choose another -o")
    if not os.path.lexists(out):
        parent = os.path.dirname(out) or "."
        if not os.path.isdir(parent):
            raise UsageError("the output's folder does not exist", path=parent,
                             fix="create it or choose another -o")
        return
    if not force:
        raise UsageError("already exists", path=out,
                         fix="pass --force to replace it once the new store is complete, or "
                         "choose another -o")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isdir(os.path.join(out, INDEX_DIR)):
        raise UsageError("exists and is a non-empty folder that is not an expertfs store; "
                         "--force only replaces stores", path=out, fix="choose another -o")


def _lock(partial: str) -> int:
    fd = os.open(os.path.join(partial, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError("another repack is writing this store right now", path=partial,
                         fix="wait for it to finish") from None
    return fd


def _open_partial(partial: str, fp: str, plan: RepackPlan, resume: bool) -> tuple[Index, int, int]:
    """The partial index and the resume point (windows done, payload bytes done)."""
    idx_path = os.path.join(partial, INDEX_DIR)
    if resume and os.path.exists(os.path.join(idx_path, "data.mdb")):
        try:
            idx = Index.open(idx_path, write=True)
            prog = json.loads(idx.meta("progress") or b"{}")
            if prog.get("fingerprint") == fp:
                log.info("resuming %s after %d windows", partial, prog["windows"])
                return idx, int(prog["windows"]), int(prog["payload"])
            idx.close()
            log.info("%s holds another repack (sources or options changed): starting over", partial)
        except (ExpertfsError, lmdb.Error, ValueError, KeyError):
            log.info("%s is unreadable: starting over", partial)
    for name in os.listdir(partial):
        if name != _LOCK:
            p = os.path.join(partial, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    idx = Index.create(idx_path)
    m = plan.model
    expert_tensors = [TensorRecord(i, t.name, KIND_EXPERT, t.ggml_type, t.ne,
                                   layer_of(t.name) if layer_of(t.name) is not None else -1, 0, t.nbytes, 0)
                      for i, t in enumerate(m.tensors) if plan.kinds[i] == KIND_EXPERT]
    idx.commit(tensors=expert_tensors, meta={"progress": json.dumps(
        {"fingerprint": fp, "windows": 0, "payload": 0}).encode()})
    return idx, 0, 0


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, exchange = -100, 2
    if fn(at_fdcwd, a.encode(), at_fdcwd, b.encode(), exchange) == 0:
        return True
    return False


def _publish(partial: str, out: str) -> None:
    if os.path.lexists(out):
        if not _exchange(partial, out):
            old = f"{out}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(partial, out)
            partial = old
        shutil.rmtree(partial) if os.path.isdir(partial) else os.unlink(partial)
    else:
        os.rename(partial, out)
    _fsync_path(os.path.dirname(out) or ".")


def repack(sources: list[str] | str, out: str, *, alignment: int = 4096, force: bool = False,
           window_bytes: int = DEFAULT_WINDOW, resume: bool = True,
           progress: Callable[[int, int], None] | None = None) -> RepackResult:
    """Repack a GGUF (or all shards of a split GGUF) into a store at ``out``.

    ``progress(done, total)`` is called with payload bytes after every window.
    """
    t0 = time.perf_counter()
    out = os.path.abspath(os.fspath(out))
    model = read_model(sources)
    plan = plan_repack(model, alignment)
    _check_output(out, model, force)
    partial = out + PARTIAL_SUFFIX
    try:
        os.makedirs(partial, exist_ok=True)
    except OSError as e:
        raise write_error(partial, e) from None
    lock = _lock(partial)
    try:
        try:
            return _run(model, plan, partial, out, window_bytes, resume, progress, t0)
        except lmdb.Error as e:
            if "No space" in str(e) or "MDB_MAP_FULL" in str(e):
                raise OSError(errno.ENOSPC, str(e)) from None
            raise
    except OSError as e:
        if is_disk_full(e):
            shutil.rmtree(partial, ignore_errors=True)
            raise DiskFullError(f"the file system is full ({e.strerror or e}); needed "
                                f"{plan.experts_size + plan.trunk_size} bytes for the store",
                                path=out, fix="free space or choose another -o; the partial "
                                "store was removed") from None
        raise write_error(partial, e) from None
    finally:
        os.close(lock)


def _run(model: GGUFModel, plan: RepackPlan, partial: str, out: str, window_bytes: int,
         resume: bool, progress: Callable[[int, int], None] | None, t0: float) -> RepackResult:
    fp = _fingerprint(model, plan.alignment, window_bytes)
    idx, skip, done_payload = _open_partial(partial, fp, plan, resume)
    outs: dict[str, tuple[int, bool]] = {}
    writer = None
    try:
        outs[TRUNK_FILE] = open_output(os.path.join(partial, TRUNK_FILE), plan.trunk_size)
        outs[EXPERTS_FILE] = open_output(os.path.join(partial, EXPERTS_FILE), plan.experts_size)
        writer = WindowWriter(plan, outs, window_capacity(plan, window_bytes))
        summary = _write_all(model, plan, idx, outs, writer, fp, window_bytes, skip,
                             done_payload, progress)
    finally:
        if writer is not None:
            writer.close()
        for fd, _ in outs.values():
            os.close(fd)
        idx.close()
    for name in (TRUNK_FILE, EXPERTS_FILE, os.path.join(INDEX_DIR, "data.mdb"), INDEX_DIR):
        _fsync_path(os.path.join(partial, name))
    os.unlink(os.path.join(partial, _LOCK))
    _fsync_path(partial)
    _publish(partial, out)
    total = plan.expert_payload + plan.trunk_payload
    return RepackResult(out, done_payload, total - done_payload, time.perf_counter() - t0,
                        all(d for _, d in outs.values()), summary)


def _write_all(model: GGUFModel, plan: RepackPlan, idx: Index, outs: dict[str, tuple[int, bool]],
               writer: WindowWriter, fp: str, window_bytes: int, skip: int, done_payload: int,
               progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    """Write every window after the first ``skip``, checkpointing; returns the summary."""
    total = plan.expert_payload + plan.trunk_payload
    pending = Completed([], [])
    state = {"windows": skip, "payload": done_payload, "since": 0}

    def checkpoint() -> None:
        for fd, is_direct in outs.values():
            os.fdatasync(fd)
            if not is_direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        meta = {"progress": json.dumps({"fingerprint": fp, "windows": state["windows"],
                                        "payload": state["payload"]}).encode()}
        idx.commit(tensors=pending.trunk, extents=pending.extents, meta=meta)
        pending.extents.clear()
        pending.trunk.clear()
        state["since"] = 0

    def on_window(w: Window, done: Completed) -> None:
        pending.extents.extend(done.extents)
        pending.trunk.extend(done.trunk)
        state["windows"] += 1
        state["payload"] += w.payload
        state["since"] += w.length
        if progress:
            progress(state["payload"], total)
        if w.checkpoint and state["since"] >= CHECKPOINT_BYTES:
            checkpoint()

    todo = windows(plan, window_bytes)
    for _ in range(skip):
        next(todo)
    if progress:
        progress(done_payload, total)
    writer.run(todo, on_window)
    checkpoint()
    summary = model_summary(model, plan)
    idx.commit(meta={
        "format_version": struct.pack("<I", FORMAT_VERSION),
        "gguf_kv": encode_kv_blob(model),
        "gguf_version": struct.pack("<I", model.shards[0].version),
        "summary": json.dumps(summary, sort_keys=True).encode(),
        "complete": b"1",
    }, delete_meta=["progress"])
    idx.env.sync(True)
    return summary
