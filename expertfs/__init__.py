"""expertfs: run Mixture-of-Experts LLMs far larger than RAM, with experts streamed from NVMe.

Sub-packages: ``expertfs.formats`` (GGUF and ggml knowledge), the store modules here
(layout, plan, writer, index, store, verify, unpack), ``expertfs.synth`` (model-shaped GGUFs)
and ``expertfs.runtime`` (the engine). Only ``expertfs.cli`` prints or exits.
"""

__version__ = "0.1.0"
