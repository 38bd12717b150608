"""Model-shaped GGUFs with real llama.cpp architectures and random weights.

    from expertfs.synth import SynthConfig, synthesize, estimate_bytes
    cfg = SynthConfig.like("GLM-4.5-Air", layers=4)          # or SynthConfig() / .tiny("llama")
    paths = synthesize(cfg, "glm-air-4l.gguf", split_max_bytes=2 << 30)

Architectures: qwen3moe, glm4moe (with its NextN block), llama (Mixtral-style MoE), deepseek2
(MLA), gpt-oss, glm-dsa (GLM-5.2: MLA + the DSA indexer) and glm5-next (GLM-5.3-Flash: KDA and
MLA layers, the k-pool indexer, mHC streams). Tensor names, shapes, order, F32 rules and metadata are those of
``convert_hf_to_gguf``; quantized tensors hold valid blocks whose weights have std about
1/sqrt(fan_in). Writing streams: memory does not grow with the model.
"""

from ..formats.random_blocks import NATIVE_TYPES, SUPPORTED_TYPES, SYNTHETIC_TYPES, make_blocks
from .archs import Init, TensorPlan, plan_tensors
from .config import ARCHES, SynthConfig
from .model import SynthModel, build_model
from .presets import PRESETS, preset_names
from .quant import MIXED_TYPES, QuantSpec, Role, parse_quant
from .tokenizer import build_vocab
from .writer import estimate_bytes, layers_for_size, synthesize

__all__ = ["SynthConfig", "synthesize", "estimate_bytes", "layers_for_size", "build_model",
           "SynthModel", "plan_tensors", "TensorPlan", "Init", "ARCHES", "PRESETS", "preset_names",
           "parse_quant", "QuantSpec", "Role", "MIXED_TYPES", "SUPPORTED_TYPES", "NATIVE_TYPES",
           "SYNTHETIC_TYPES", "make_blocks", "build_vocab"]
