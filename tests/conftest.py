"""Shared fixtures, and the skips by marker (llama, gpu, nogpu)."""

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


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Skips by marker: ``llama`` unless opted in, ``gpu`` without CUDA, ``nogpu`` with it."""
    llama = os.environ.get("EXPERTFS_LLAMA_TESTS") == "1"
    cuda = _cuda()
    skips = {
        "llama": None if llama else pytest.mark.skip(
            reason="llama.cpp tests are opt-in: set EXPERTFS_LLAMA_TESTS=1 "
                   "(needs llama-cpp-python, a long build)"),
        "gpu": None if cuda else pytest.mark.skip(reason="needs CUDA"),
        "nogpu": pytest.mark.skip(reason="checks the CPU-only behaviour") if cuda else None,
    }
    for item in items:
        for name, skip in skips.items():
            if skip is not None and item.get_closest_marker(name) is not None:
                item.add_marker(skip)
