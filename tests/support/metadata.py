"""Bad metadata made from a real store's: one key removed or replaced, then the config read."""

from __future__ import annotations

from typing import Any

import pytest


def assert_metadata_refused(store: str, arch: str, key: str, value: Any, needle: str) -> None:
    """``{arch}.{key}`` dropped (``value`` None) or replaced: a typed error matching ``needle``
    that points at llama.cpp's converter."""
    from expertfs.errors import UnsupportedModelError
    from expertfs.runtime.model.config import ModelConfig
    from expertfs.store.reader import Store
    with Store.open(store) as st:
        kv = dict(st.gguf_kv())
    kv.pop(f"{arch}.{key}")
    if value is not None:
        kv[f"{arch}.{key}"] = value
    with pytest.raises(UnsupportedModelError, match=needle) as e:
        ModelConfig.from_gguf(kv, path="model.gguf")
    assert "convert_hf_to_gguf" in str(e.value)
