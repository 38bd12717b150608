"""The store's records, byte for byte, as FORMAT.md specifies them."""

from __future__ import annotations

from support import REPO
import re

import pytest

from expertfs.formats.ggml import GGMLType
from expertfs.formats.moe_names import Role
from expertfs.store.layout import (FORMAT_VERSION, KIND_TRUNK, Extent, Part, TensorRecord, expert_key,
                             pack_extent, pack_tensor, pack_usage, tensor_key, unpack_extent,
                             unpack_tensor, unpack_usage)

DOC = (REPO / "FORMAT.md").read_text()
Q8 = GGMLType.Q8_0
EXTENT = Extent(3, 17, 1 << 20, 36864, (
    Part(Role.GATE, Q8, 10, (256, 32), 0, 8704, 0x1122334455667788),
    Part(Role.UP, Q8, 11, (256, 32), 12288, 8704, 0x99AABBCCDDEEFF00),
    Part(Role.DOWN, Q8, 12, (32, 256), 24576, 8704, 0x0123456789ABCDEF)))
TENSOR = TensorRecord(5, "blk.0.attn_q.weight", KIND_TRUNK, Q8, (256, 256), 0, 8192, 69632,
                      0xCAFEF00DDEADBEEF)


def golden(name: str) -> bytes:
    m = re.search(rf"```golden {name}\n(.*?)```", DOC, re.S)
    assert m, f"FORMAT.md has no golden block {name!r}"
    return bytes.fromhex(m.group(1).replace("\n", " "))


def test_doc_names_this_version():
    assert f"version {FORMAT_VERSION}" in DOC.splitlines()[0]


@pytest.mark.parametrize("name,value", [
    ("expert_key", expert_key(3, 17)),
    ("extent", pack_extent(EXTENT)),
    ("tensor_key", tensor_key(5)),
    ("tensor", pack_tensor(TENSOR)),
    ("usage", pack_usage(42)),
])
def test_record_bytes(name, value):
    assert value == golden(name)


def test_records_decode_back():
    assert unpack_extent(golden("expert_key"), golden("extent")) == EXTENT
    assert unpack_tensor(golden("tensor_key"), golden("tensor")) == TENSOR
    assert unpack_usage(golden("usage")) == 42


def test_keys_sort_numerically():
    keys = [expert_key(layer, e) for layer in (0, 1, 2, 255, 256) for e in (0, 1, 300)]
    assert sorted(keys) == keys
