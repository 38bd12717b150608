"""``runtime.heap.configure``: the heap thresholds set once through glibc's ``mallopt``, the
user's own malloc tuning left alone."""

from __future__ import annotations

import ctypes
import os
import types

import pytest

from expertfs.runtime import heap


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(heap, "_done", [])
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)


def test_sets_the_thresholds_once_where_glibc_has_mallopt(fresh, monkeypatch):
    calls = []

    def mallopt(param, value):                 # records instead of changing this process
        calls.append((param, value))
        return 1
    monkeypatch.setattr(ctypes, "CDLL", lambda name: types.SimpleNamespace(mallopt=mallopt))
    assert heap.configure() is True
    assert heap.configure() is True                # once
    assert calls == [(-3, heap.MMAP_THRESHOLD), (-1, heap.TRIM_THRESHOLD)]


@pytest.mark.parametrize("env", [("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1"),
                                 ("MALLOC_ARENA_MAX_", "2")])
def test_the_users_malloc_tuning_wins(fresh, monkeypatch, env):
    monkeypatch.setenv(*env)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: pytest.fail("mallopt called"))
    assert heap.configure() is False


def test_no_mallopt_is_not_an_error(fresh, monkeypatch):
    def missing(name):
        raise OSError("no C library")
    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert heap.configure() is False
