"""``repack``: GGUF → store, crash-safe and resumable.

The store is built in ``OUT.partial/`` and appears at ``OUT`` by one atomic rename once every
byte is written, synced and indexed. Progress is checkpointed in the partial index (data
synced first, then one LMDB transaction with the finished records and the resume point), so a
repack killed at any moment leaves either no store or a complete one, and running it again
resumes from the last checkpoint when the sources and options are unchanged (and restarts
cleanly when they are not). A full disk removes the partial store and says so.

With ``consume_source`` the GGUF's bytes are released as the store takes them over (see
``consume``: the release rule, and why a resumed run never reads a released byte); the outputs
are then sparse instead of preallocated, and a full disk keeps the partial store once any
source byte is released, since it holds the only copy.
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import lmdb
import xxhash
import zstandard

from ..errors import DiskFullError, ExpertfsError, IntegrityError, UsageError
from ..formats.gguf_read import GGUFModel
from ..formats.gguf_split import read_model
from . import consume as cs
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


def _fingerprint(model: GGUFModel, alignment: int, window_bytes: int, in_place: bool = False) -> str:
    h = xxhash.xxh3_128()
    h.update(json.dumps([FORMAT_VERSION, alignment, window_bytes] + (["in place"] if in_place
                                                                     else [])).encode())
    for s in model.shards:
        st = os.stat(s.path)       # in place, punching holes changes the mtime: size and header
        h.update(struct.pack("<QQ", st.st_size, 0 if in_place else st.st_mtime_ns))
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


def _open_partial(partial: str, fp: str, plan: RepackPlan,
                  resume: bool) -> tuple[Index, int, int, int]:
    """The partial index and the resume point (windows done, payload done, windows released)."""
    idx_path = os.path.join(partial, INDEX_DIR)
    consuming = os.path.exists(os.path.join(partial, cs.CONSUMING))
    if resume and os.path.exists(os.path.join(idx_path, "data.mdb")):
        try:
            idx = Index.open(idx_path, write=True)
            prog = json.loads(idx.meta("progress") or b"{}")
            if prog.get("fingerprint") == fp:
                log.info("resuming %s after %d windows", partial, prog["windows"])
                return idx, int(prog["windows"]), int(prog["payload"]), int(prog.get("released", 0))
            idx.close()
            log.info("%s holds another repack (sources or options changed): starting over", partial)
        except (ExpertfsError, lmdb.Error, ValueError, KeyError):
            log.info("%s is unreadable: starting over", partial)
    if consuming:
        raise UsageError("holds bytes an interrupted `repack --consume-source` already released "
                         "from the source, so it cannot start over", path=partial,
                         fix="run that command again, with the same sources, -o, --align and "
                         "--consume-source and without --restart, to finish the store")
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
        {"fingerprint": fp, "windows": 0, "payload": 0, "released": 0}).encode()})
    return idx, 0, 0, 0


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
           progress: Callable[[int, int], None] | None = None, consume_source: bool = False,
           on_freed: Callable[[int], None] | None = None,
           full_readback: bool = False) -> RepackResult:
    """Repack a GGUF (or all shards of a split GGUF) into a store at ``out``.

    ``progress(done, total)`` is called with payload bytes after every window. With
    ``consume_source`` the source files are emptied as the store fills and deleted once it is
    published (destructive; ``consume``); ``on_freed(bytes)`` reports the disk freed so far;
    ``full_readback`` reads every window back whole before releasing it, not just spots of it.
    """
    t0 = time.perf_counter()
    out = os.path.abspath(os.fspath(out))
    if consume_source:
        done = cs.already_published(out, [sources] if isinstance(sources, str) else sources)
        if done is not None:
            total = done["expert_bytes"] + done["trunk_bytes"]
            return RepackResult(out, total, 0, time.perf_counter() - t0, True, done)
    model = read_model(sources)
    plan = plan_repack(model, alignment)
    fp = _fingerprint(model, plan.alignment, window_bytes, consume_source)
    if consume_source:
        cs.check_sources(model.paths)
    _check_output(out, model, force)
    partial = out + PARTIAL_SUFFIX
    if consume_source:
        if not os.path.exists(os.path.join(partial, cs.CONSUMING)):
            cs.check_exact(model)
        cs.check_space(plan, out, window_bytes, CHECKPOINT_BYTES)
    try:
        os.makedirs(partial, exist_ok=True)
    except OSError as e:
        raise write_error(partial, e) from None
    lock = _lock(partial)
    try:
        try:
            return _run(model, plan, partial, out, fp, window_bytes, resume, progress, t0,
                        consume_source, on_freed, full_readback)
        except lmdb.Error as e:
            if "No space" in str(e) or "MDB_MAP_FULL" in str(e) or _full(partial):
                raise OSError(errno.ENOSPC, str(e)) from None   # (tmpfs says EIO when full)
            raise
    except OSError as e:
        if is_disk_full(e) and os.path.exists(os.path.join(partial, cs.CONSUMING)):
            raise DiskFullError(f"the file system is full ({e.strerror or e}); the partial store "
                                "was kept: it holds bytes already released from the source",
                                path=out, fix="free space, then run the same command again to "
                                "resume") from None
        if is_disk_full(e):
            shutil.rmtree(partial, ignore_errors=True)
            raise DiskFullError(f"the file system is full ({e.strerror or e}); needed "
                                f"{plan.experts_size + plan.trunk_size} bytes for the store",
                                path=out, fix="free space or choose another -o (or build the "
                                "store in place of the GGUF with --consume-source); the partial "
                                "store was removed") from None
        raise write_error(partial, e) from None
    finally:
        os.close(lock)


def _full(path: str) -> bool:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize < (1 << 20)


def _run(model: GGUFModel, plan: RepackPlan, partial: str, out: str, fp: str, window_bytes: int,
         resume: bool, progress: Callable[[int, int], None] | None, t0: float,
         in_place: bool, on_freed: Callable[[int], None] | None,
         full_readback: bool = False) -> RepackResult:
    idx, skip, done_payload, released = _open_partial(partial, fp, plan, resume)
    outs: dict[str, tuple[int, bool]] = {}
    writer = consumer = None
    try:
        for name, size in ((TRUNK_FILE, plan.trunk_size), (EXPERTS_FILE, plan.experts_size)):
            outs[name] = open_output(os.path.join(partial, name), size, prealloc=not in_place)
        if in_place:
            consumer = cs.Consumer(model, partial, {n: os.path.join(partial, n) for n in outs},
                                   on_freed, full_readback)
        writer = WindowWriter(plan, outs, window_capacity(plan, window_bytes),
                              sample=consumer.digests if consumer is not None else None)
        summary = _write_all(model, plan, idx, outs, writer, fp, window_bytes,
                             (skip, done_payload, released), progress, consumer)
    finally:
        if writer is not None:
            writer.close()
        if consumer is not None:
            consumer.close()
        for fd, _ in outs.values():
            os.close(fd)
        idx.close()
    for name in (TRUNK_FILE, EXPERTS_FILE, os.path.join(INDEX_DIR, "data.mdb"), INDEX_DIR):
        _fsync_path(os.path.join(partial, name))
    os.unlink(os.path.join(partial, _LOCK))
    _fsync_path(partial)
    _publish(partial, out)
    if in_place:
        cs.finish_in_place(out, model.paths)
    total = plan.expert_payload + plan.trunk_payload
    return RepackResult(out, done_payload, total - done_payload, time.perf_counter() - t0,
                        all(d for _, d in outs.values()), summary)


def _write_all(model: GGUFModel, plan: RepackPlan, idx: Index, outs: dict[str, tuple[int, bool]],
               writer: WindowWriter, fp: str, window_bytes: int, start: tuple[int, int, int],
               progress: Callable[[int, int], None] | None,
               consumer: cs.Consumer | None) -> dict[str, Any]:
    """Write every window after the first ``start[0]``, checkpointing (and, in place, releasing
    the source bytes of each checkpoint's windows); returns the summary."""
    total = plan.expert_payload + plan.trunk_payload
    skip, done_payload, released = start
    pending = Completed([], [])
    state = {"windows": skip, "payload": done_payload, "since": 0, "released": released,
             "released_payload": 0}
    unreleased: list[tuple[Window, cs.Spots | None]] = []   # spots: None if written before
    releasing: list[tuple[Future[None], int, int]] = []   # the batch in flight, at most one

    def progress_meta(windows: int, payload: int) -> dict[str, bytes]:
        return {"progress": json.dumps({"fingerprint": fp, "windows": windows, "payload": payload,
                                        "released": state["released"]}).encode()}

    def wait_release() -> None:
        if not releasing:
            return
        fut, n, payload = releasing.pop()
        try:
            fut.result()
        except (IntegrityError, OSError):   # rewind to what is released: the rest is rewritten
            idx.commit(meta=progress_meta(state["released"], state["released_payload"]))
            raise
        state["released"], state["released_payload"] = n, payload

    def release(sums: dict[tuple[int, ...], int] | Index) -> None:
        wait_release()
        batch = list(unreleased)
        unreleased.clear()
        releasing.append((pool.submit(consumer.release, batch, sums), state["windows"],
                          state["payload"]))

    def checkpoint() -> None:
        for fd, is_direct in outs.values():
            os.fdatasync(fd)
            if not is_direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        idx.commit(tensors=pending.trunk, extents=pending.extents,
                   meta=progress_meta(state["windows"], state["payload"]))
        sums = cs.checksums(pending.extents, pending.trunk) if consumer is not None else {}
        pending.extents.clear()
        pending.trunk.clear()
        state["since"] = 0
        if consumer is not None:
            release(sums)

    def on_window(w: Window, done: Completed) -> None:
        pending.extents.extend(done.extents)
        pending.trunk.extend(done.trunk)
        state["windows"] += 1
        state["payload"] += w.payload
        state["since"] += w.length
        if consumer is not None:
            unreleased.append((w, done.spots))
        if progress:
            progress(state["payload"], total)
        if w.checkpoint and state["since"] >= CHECKPOINT_BYTES:
            checkpoint()

    todo = windows(plan, window_bytes)
    for i in range(skip):
        w = next(todo)
        if consumer is not None and i < released:
            consumer.mark_released([w])
            state["released_payload"] += w.payload
        elif consumer is not None:
            unreleased.append((w, None))
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertfs-release")
    try:
        if consumer is not None:
            release(idx)        # windows durable but not yet released when the last run died
            wait_release()
        if progress:
            progress(done_payload, total)
        writer.run(todo, on_window)
        checkpoint()
        wait_release()
    finally:
        pool.shutdown(wait=True)
    summary = model_summary(model, plan)
    if consumer is not None:
        summary["in_place"] = {
            "fingerprint": fp, "released_bytes": consumer.freed,
            "sources": [os.path.basename(p) for p in model.paths],
            "headers": [[os.path.basename(f.path), f.size, f.data_offset,
                         cs.head_digest(f.path, f.data_offset)] for f in model.shards]}
    idx.commit(meta={
        "format_version": struct.pack("<I", FORMAT_VERSION),
        "gguf_kv": encode_kv_blob(model),
        "gguf_version": struct.pack("<I", model.shards[0].version),
        "summary": json.dumps(summary, sort_keys=True).encode(),
        "complete": b"1",          # in place the resume point stays until published: see _run
        **(progress_meta(state["windows"], state["payload"]) if consumer is not None else {}),
    }, delete_meta=["progress"] if consumer is None else [])
    idx.env.sync(True)
    return summary
