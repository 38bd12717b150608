"""Faults in expert reads during a decode through the tiered provider: a transient EIO, short read
or checksum mismatch is retried and gives the clean run's tokens; a persistent one ends the run
with a typed error naming the layer, expert and file (never a wrong token), and the engine runs
cleanly afterwards; a store truncated or replaced under the engine is a typed error."""

from __future__ import annotations

import os
import shutil

import pytest

from expertfs.runtime.io import ExpertIntegrityError, IOFaultError
from expertfs.runtime.io.errors import StoreChangedError
from support.cache_store import make_store
from support.faults import Fault, FaultyRun

@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("faultstore"))


Run = FaultyRun


@pytest.fixture(scope="module")
def clean(store_dir):
    r = Run(store_dir)
    try:
        toks = r.tokens()
        assert r.tokens() == toks            # deterministic
        assert r.eng.provider.stats.misses > 48   # experts are read again: faults can land
        return toks
    finally:
        r.close()


@pytest.mark.parametrize("fault,verify", [
    (Fault("eio", times=2), "first"), (Fault("short", times=3), "first"),
    (Fault("short", times=2, keep=0), "first"), (Fault("corrupt", times=1), "always"),
])
def test_transient_fault_gives_the_clean_tokens(store_dir, clean, fault, verify) -> None:
    r = Run(store_dir, verify=verify)
    try:
        assert r.tokens(lambda run: run.faults.add(fault)) == clean
        assert r.faults.hits[fault.kind] > 0
        if fault.kind == "corrupt":
            assert r.reader.stats["recovered"] == 1 and r.reader.stats["integrity_errors"] == 0
    finally:
        r.close()


def test_corruption_on_a_first_read_is_caught_by_default(store_dir, clean) -> None:
    r = Run(store_dir)                      # verify="first": the first read of each expert
    try:
        r.faults.add(Fault("corrupt", times=1))
        assert r.tokens() == clean and r.reader.stats["recovered"] == 1
    finally:
        r.close()


def _named(err, store_dir) -> None:
    msg = str(err)
    assert err.layer is not None and f"layer {err.layer}, expert {err.expert}" in msg
    assert str(store_dir) in msg and err.fix


@pytest.mark.parametrize("fault,error,verify", [
    (Fault("eio", times=-1), IOFaultError, "first"),
    (Fault("short", times=-1, keep=0), IOFaultError, "first"),
    (Fault("corrupt", times=-1), ExpertIntegrityError, "always"),
])
def test_persistent_fault_is_a_typed_error_then_the_engine_recovers(store_dir, clean, fault,
                                                                    error, verify) -> None:
    r = Run(store_dir, verify=verify)
    try:
        with pytest.raises(error) as e:
            r.tokens(lambda run: run.faults.add(fault))
        _named(e.value, store_dir)
        r.clear()
        assert r.tokens() == clean           # nothing half-loaded was kept
    finally:
        r.close()


def _copy(store_dir, tmp_path):
    dst = tmp_path / "copy.efs"
    shutil.copytree(store_dir, dst)
    return dst


def test_store_truncated_under_the_engine(store_dir, clean, tmp_path) -> None:
    path = _copy(store_dir, tmp_path)
    r = Run(path)
    try:
        with pytest.raises(StoreChangedError, match="truncated") as e:
            r.tokens(lambda run: os.truncate(run.store.experts_path, 4096))
        _named(e.value, path)
    finally:
        r.close()


@pytest.mark.parametrize("how", ["rename", "rewrite"])
def test_store_replaced_under_the_engine(store_dir, clean, tmp_path, how) -> None:
    path = _copy(store_dir, tmp_path)
    r = Run(path)

    def replace(run: Run) -> None:
        bins = run.store.experts_path
        data = bytes(b ^ 0x55 for b in open(bins, "rb").read())   # another file, same size
        if how == "rename":
            with open(bins + ".new", "wb") as f:
                f.write(data)
            os.replace(bins + ".new", bins)
        else:
            st = os.stat(bins)
            with open(bins, "r+b") as f:
                f.write(data)
            os.utime(bins, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    try:
        with pytest.raises(StoreChangedError, match="replaced" if how == "rename" else "rewritten"):
            r.tokens(replace)
    finally:
        r.close()
