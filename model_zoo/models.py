"""From a Hugging Face config.json dict to the model class that runs it."""
from torch import nn

from model_zoo.deepseek_v4 import DeepseekV4ForCausalLM
from model_zoo.gemma3 import Gemma3ForCausalLM
from model_zoo.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

# HF `architectures[0]` -> class.
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
}

# HF `model_type` -> class, for configs without `architectures` (e.g. from GGUF).
MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}


def model_class(config: dict) -> type[nn.Module]:
    archs = config.get("architectures") or []
    if archs:
        if archs[0] in ARCHITECTURES:
            return ARCHITECTURES[archs[0]]
        name = archs[0]
    else:
        if config.get("model_type") in MODEL_TYPES:
            return MODEL_TYPES[config["model_type"]]
        name = f"model_type {config.get('model_type')!r}"
    raise ValueError(f"unsupported architecture {name}; supported: {', '.join(ARCHITECTURES)} "
                     f"(model_type {', '.join(MODEL_TYPES)})")


def build_model(config: dict) -> nn.Module:
    """The model for an HF config dict, with uninitialised weights: call
    load_weights next. Built in the current default dtype and device."""
    return model_class(config)(config)
