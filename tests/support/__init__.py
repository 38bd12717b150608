"""What the tests share: builders of real GGUFs and stores, fixtures, fakes and fault injection.

``gguf_builders`` (small GGUFs with llama.cpp's names and metadata), ``cache_store`` (a tiny
repacked store, a read gate, residency invariants), ``mtp_model`` (a glm4moe with a NextN block),
``faults`` (an I/O backend that injects errors). ``REPO``, ``TOOLS`` and ``BENCH`` are the
checkout's folders (``tools/`` is on ``sys.path`` for every test: ``conftest.py``).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
BENCH = REPO / "bench"
