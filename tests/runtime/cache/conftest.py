"""The tiny real store most cache tests run on (``support.cache_store.make_store``: glm4moe, a
dense lead block, 16 experts of mixed quant types a routed layer), built once per test module;
a module that needs another store defines its own ``store``."""

from __future__ import annotations

import pytest

from expertfs.store.reader import Store
from support.cache_store import make_store


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("store"))


@pytest.fixture
def store(store_path):
    s = Store.open(str(store_path))
    yield s
    s.close()
