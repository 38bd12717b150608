"""``model.scratch``: per-thread named float32 buffers, grown and never shrunk, reused by the
prompt's large temporaries (MLA's chunked output and per-call heads, the row chunks of
``wide.dequant_linear``)."""

from __future__ import annotations

import threading

import torch

from expertfs.runtime.model import scratch


def test_a_name_keeps_its_memory_and_grows_only_when_asked_for_more():
    a = scratch.buffer("t_a", 100)
    assert a.dtype == torch.float32 and a.numel() == 100
    assert scratch.buffer("t_a", 60).data_ptr() == a.data_ptr()       # the same pages
    big = scratch.buffer("t_a", 1000)
    assert big.numel() == 1000
    assert scratch.buffer("t_a", 100).data_ptr() == big.data_ptr()   # never shrunk


def test_names_and_threads_never_share_memory():
    a, b = scratch.buffer("t_x", 64), scratch.buffer("t_y", 64)
    assert a.data_ptr() != b.data_ptr()
    seen = []
    t = threading.Thread(target=lambda: seen.append(scratch.buffer("t_x", 64).data_ptr()))
    t.start()
    t.join()
    assert seen and seen[0] != a.data_ptr()
