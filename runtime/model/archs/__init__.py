"""Per-architecture composition, as llama.cpp's ``src/models/<arch>.cpp``: one short module per
family that has layer kinds of its own, naming and composing them from its GGUF metadata.

The generic pre-norm stack (``model.Model``: embedding → blocks → output norm), the FFNs, the
router and the expert path are shared; an architecture module (``ArchSpec.module``) adds:

- ``configure(cfg, get, path) -> ModelConfig``: its own metadata keys (``get(key, default)``
  reads ``"{arch}.{key}"``) into ``cfg.ext``, its defaults, typed errors for bad values;
- ``load_attention(builder, prefix, layer)``: the attention weights of block ``layer`` under
  llama.cpp's tensor names (``builder`` is the loader's, with ``lin``/``vec``/``mla``);
- ``Attention(cfg, cache)``: the attention step the stack calls for every trunk layer, with the
  ``mla.mla_attention`` / ``attention.attention`` signature; it may register per-layer side
  streams in the KV cache (``KVCache.add_stream``).

The architectures without a module (qwen3moe, glm4moe, llama, deepseek2) run the stack as is.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["arch_module"]


def arch_module(spec: Any) -> ModuleType | None:
    """The module that composes ``spec``'s architecture, or None for the plain stack."""
    if getattr(spec, "module", None) is None:
        return None
    return importlib.import_module(f"{__name__}.{spec.module}")
