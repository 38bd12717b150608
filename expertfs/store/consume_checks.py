"""Pre-flight checks of ``repack --consume-source``: the sources may be consumed (no other
names, writable, on a file system that punches holes), unpack would give them back bit for bit,
and the output's file system can hold what is written before it is released.
"""

from __future__ import annotations

import ctypes
import os
import tempfile

from ..errors import DiskFullError, UsageError
from ..formats.gguf_read import GGUFModel
from ..formats.gguf_write import TensorSpec, header_bytes, pad_to
from .plan import RepackPlan
from .windows import windows

__all__ = ["punch_hole", "fs_type", "check_sources", "check_exact", "check_space"]


_PUNCH, _KEEP = 0x02, 0x01           # FALLOC_FL_PUNCH_HOLE, FALLOC_FL_KEEP_SIZE
_libc = None


def punch_hole(fd: int, off: int, length: int) -> None:
    """Deallocate ``[off, off + length)`` of ``fd`` keeping its size; OSError on failure."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, _PUNCH | _KEEP, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def fs_type(path: str) -> str:
    """The type of the file system holding ``path`` (from /proc/self/mountinfo), or 'unknown'."""
    try:
        st = os.stat(path)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        real = os.path.realpath(path)
        best, kind = "", "unknown"
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or fields[2] != dev:
                    continue
                mnt = fields[4]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, right.split()[0]
        return kind
    except (OSError, IndexError):
        return "unknown"


def _probe(folder: str) -> OSError | None:
    """Punch a hole in a scratch file beside the source; the error, or None when it works."""
    try:
        fd, name = tempfile.mkstemp(prefix=".expertfs-punch-probe-", dir=folder)
    except OSError as e:
        return e
    try:
        os.write(fd, bytes(3 * 4096))
        punch_hole(fd, 4096, 4096)
        return None
    except OSError as e:
        return e
    finally:
        os.close(fd)
        os.unlink(name)


def check_sources(paths: list[str]) -> None:
    """Refuse sources that consuming would harm or cannot release (typed errors)."""
    fix = "repack without --consume-source"
    for p in paths:
        st = os.lstat(p)
        if os.path.islink(p):
            raise UsageError("is a symbolic link; --consume-source would empty the file it "
                             f"points to ({os.path.realpath(p)}) behind another name", path=p,
                             fix="pass the real file, or " + fix)
        if st.st_nlink > 1:
            raise UsageError(f"has {st.st_nlink} hard links; --consume-source would empty the "
                             "file under its other names too", path=p,
                             fix="remove the other links first, or " + fix)
        if not os.access(p, os.W_OK):
            raise UsageError("is not writable, and --consume-source releases its bytes in "
                             "place", path=p, fix="make it writable, or " + fix)
    for folder in sorted({os.path.dirname(os.path.abspath(p)) for p in paths}):
        err = _probe(folder)
        if err is not None:
            raise UsageError(f"the file system here ({fs_type(folder)}) cannot punch holes "
                             f"(fallocate PUNCH_HOLE: {err.strerror}), so --consume-source "
                             "cannot release the GGUF's bytes", path=folder,
                             fix=fix + ", or move the GGUF to ext4, XFS, btrfs or tmpfs")


def check_exact(model: GGUFModel) -> None:
    """Refuse a source that unpack would not give back bit for bit (nothing to release then).

    Every shard's header must be the one llama.cpp's writer makes from its metadata and tensor
    table, its tensors packed in table order, the padding zero and the data section whole.
    """
    for f in model.shards:
        specs = [TensorSpec(t.name, t.ne, t.ggml_type) for t in f.tensors]
        head, _ = header_bytes([e.raw for e in f.kv.values()], specs, f.alignment, f.version)
        end = f.data_offset + sum(pad_to(t.nbytes, f.alignment) for t in f.tensors)
        why = None
        if not f.canonical or len(head) != f.data_offset or end != f.size:
            why = "its layout is not llama.cpp's packed one"
        fd = os.open(f.path, os.O_RDONLY)
        try:
            if why is None and os.pread(fd, len(head), 0) != head:
                why = "its header is not the one llama.cpp writes for its metadata"
            if why is None and os.lseek(fd, f.data_offset, os.SEEK_HOLE) < f.size:
                why = "its data section has holes (an earlier --consume-source run released part " \
                      "of it?)"
            gaps = [(t.data_start + t.nbytes, pad_to(t.nbytes, f.alignment) - t.nbytes)
                    for t in f.tensors]
            if why is None and any(n and os.pread(fd, n, off) != bytes(n) for off, n in gaps):
                why = "its padding between tensors is not zero"
        finally:
            os.close(fd)
        if why:
            raise UsageError(f"unpack would not give this file back bit for bit ({why}), so "
                             "--consume-source would lose bytes", path=f.path,
                             fix="repack without --consume-source")


def check_space(plan: RepackPlan, out: str, window_bytes: int, checkpoint_bytes: int) -> None:
    """Refuse when the output's file system cannot hold what is written before it is released.

    In place, the extra disk at any moment is what was written since the last release (up to
    two checkpoints, or a trunk tensor larger than one) plus the store's padding so far and the
    index; on another file system than the source it is the whole store.
    """
    folder = os.path.dirname(out) or "."
    same = all(os.stat(p).st_dev == os.stat(folder).st_dev for p in plan.model.paths)
    n_parts = sum(lp.n_experts * len(lp.parts) for lp in plan.layers)
    index = 2 * (plan.n_extents * 24 + n_parts * 64 + len(plan.model.tensors) * 160) + (1 << 20)
    if same:
        need, written, payload, since, released, pending = 0, 0, 0, 0, 0, 0
        for w in windows(plan, window_bytes):    # a batch is released while the next is written
            written, payload, since = written + w.length, payload + w.payload, since + w.length
            need = max(need, written - released)
            if w.checkpoint and since >= checkpoint_bytes:
                released, pending, since = pending, payload, 0
    else:
        need = plan.experts_size + plan.trunk_size
    need += index
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if free < need:
        where = "in place of the GGUF" if same else "on this other file system than the GGUF's"
        raise DiskFullError(f"the file system ({fs_type(folder)}) has {free} bytes free; building "
                            f"the store {where} needs about {need}", path=folder,
                            fix="free space, then run the same command again")
