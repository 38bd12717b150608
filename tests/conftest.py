"""Shared fixtures and the opt-in skip of the llama.cpp tests."""

import os
import sys
from pathlib import Path

import pytest

from expertfs.runtime.openmp import configure

configure()                 # the wait policy the CLI runs torch with, before torch loads

# tests/ for ``support``, tools/ for the fixture builders and exporters the tests run
sys.path.insert(0, str(Path(__file__).parent))
from support import TOOLS  # noqa: E402

sys.path.insert(0, str(TOOLS))

from support.gguf_builders import moe_gguf  # noqa: E402


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return moe_gguf(tmp_path / "tiny.gguf")[0]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("EXPERTFS_LLAMA_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="llama.cpp tests are opt-in: set EXPERTFS_LLAMA_TESTS=1 "
                            "(needs llama-cpp-python, a long build)")
    for item in items:
        if item.get_closest_marker("llama") is not None:
            item.add_marker(skip)
