"""The MoE decoder in torch: config from GGUF metadata, trunk from the store, experts from a
provider. One concept per module:

``config`` (``ModelConfig``, the arch table), ``weights`` (``trunk.bin`` views, ``Linear``,
``Embedding``), ``loader`` (per-block weights by llama.cpp tensor name, NextN included),
``rope`` (RMSNorm, RoPE NEOX/NORM, partial, YaRN), ``attention`` (GQA + KV cache), ``mla``
(DeepSeek latent attention), ``router`` (llama.cpp's ``build_moe_ffn`` selection), ``ffn``
(SwiGLU dense and routed), ``qmatvec`` (compiled one-token products from ggml bytes),
``dqcache`` (dequantized-expert LRU),
``moe`` (the routed layer: one host sync, fetch once per batch, gather/scatter), ``indexer``
(the DSA lightning indexer: top-k positions per query, its key cache), ``model`` (the forward).
Architectures: qwen3moe, glm4moe, llama (Mixtral), deepseek2 run the generic stack; ``archs``
holds one module per architecture with layer kinds of its own (``glm_dsa``: GLM-5.2 / GLM-5).
"""

from .config import ARCHS, ModelConfig
from .dqcache import DequantCache, dequant_cache
from .loader import TrunkWeights, load_trunk
from .model import Model
from .moe import ExpertRunner, MoEStats
from .router import Router
from .weights import TrunkReader

__all__ = ["ARCHS", "ModelConfig", "DequantCache", "dequant_cache", "TrunkWeights", "load_trunk",
           "Model", "ExpertRunner", "MoEStats", "Router", "TrunkReader"]
