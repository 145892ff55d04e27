"""From a Hugging Face config.json dict to the model class that runs it, and
to that model with its weights on a device."""
from collections.abc import Iterable

import torch
from torch import nn

from model_zoo.deepseek_v4 import DeepseekV4ForCausalLM
from model_zoo.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from model_zoo.gemma4 import Gemma4ForCausalLM
from model_zoo.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from model_zoo.qwen3_moe import Qwen3MoeForCausalLM
from model_zoo.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

# HF `architectures[0]` -> class.
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,         # its language model (text only)
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,   # with its vision tower
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,            # its language model (text only)
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
}

# HF `model_type` -> class, for configs without `architectures` (e.g. from GGUF).
MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma4_text": Gemma4ForCausalLM,
}


def classifier_labels(config: dict) -> list[str] | None:
    """A classifier's labels, or None for a plain language model: a token
    classifier's tokens (vLLM's classifier_from_token: a reranker such as
    Qwen3-Reranker scores with its LM head's logits of these tokens at the
    last position), else a sequence-classification checkpoint's (its trained
    score head, id2label's order)."""
    labels = config.get("classifier_from_token")
    if labels is not None:
        if not isinstance(labels, list) or len(labels) < 2 or not all(isinstance(t, str) for t in labels):
            raise ValueError(f"classifier_from_token must list at least two tokens, got {labels!r}")
        return labels
    if has_score_head(config):
        id2label = config.get("id2label") or {}
        n = int(config.get("num_labels") or len(id2label) or 2)
        return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]
    return None


def has_score_head(config: dict) -> bool:
    """A sequence-classification checkpoint with a trained head (`score.weight`)."""
    archs = config.get("architectures") or []
    return bool(archs) and archs[0].endswith("ForSequenceClassification") and "classifier_from_token" not in config


def model_class(config: dict) -> type[nn.Module]:
    archs = config.get("architectures") or []
    if archs:
        if archs[0] in ARCHITECTURES:
            return ARCHITECTURES[archs[0]]
        # A classifier is its CausalLM: the LM head's logits of some tokens score,
        # or a score head beside it (build_model).
        causal = archs[0].removesuffix("ForSequenceClassification") + "ForCausalLM"
        if archs[0].endswith("ForSequenceClassification") and causal in ARCHITECTURES:
            return ARCHITECTURES[causal]
        # A bare backbone (Qwen3Model: an embedding checkpoint saved by AutoModel)
        # is its CausalLM's model without the head (hf_loader.backbone_names).
        causal = archs[0].removesuffix("Model") + "ForCausalLM"
        if archs[0].endswith("Model") and causal in ARCHITECTURES:
            return ARCHITECTURES[causal]
        name = archs[0]
    else:
        if config.get("model_type") in MODEL_TYPES:
            return MODEL_TYPES[config["model_type"]]
        name = f"model_type {config.get('model_type')!r}"
    raise ValueError(f"unsupported architecture {name}; supported: {', '.join(ARCHITECTURES)} "
                     f"(model_type {', '.join(MODEL_TYPES)})")


def build_model(config: dict) -> nn.Module:
    """The model for an HF config dict, with uninitialised weights: call
    load_weights next. Built in the current default dtype and device. A
    sequence classifier gets its `score` head (hidden -> labels, whole on
    every rank: it is small and the final hidden states are too)."""
    model = model_class(config)(config)
    if has_score_head(config):
        model.score = nn.Linear(config["hidden_size"], len(classifier_labels(config)), bias=False)
    return model


def create_model(config: dict, dtype: torch.dtype, device: str | torch.device,
                 weights: Iterable[tuple[str, torch.Tensor]] | None = None, seed: int = 0,
                 stored: dict[str, str] | None = None) -> nn.Module:
    """The model for a config with its weights on `device`, in eval mode.

    Built on the meta device (no memory), given uninitialised storage on
    `device` (materialize), then filled from `weights`, HF-named tensors the
    model's load_weights copies in one at a time (the host never holds a
    second copy of the model; a missing tensor raises, naming it), or,
    weights None, with dummy values (init_dummy_weights). stored: {checkpoint
    tensor: format} of the tensors the layers keep in their stored format
    (they come as parallel.quant.base.QuantizedTensor in `weights`)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = build_model(config)
    finally:
        torch.set_default_dtype(prev)
    if stored:
        if not hasattr(model, "use_stored"):
            raise ValueError(f"{type(model).__name__} cannot keep weights in their stored format")
        model.use_stored(stored)
    materialize(model, device)
    with torch.no_grad():
        if weights is None:
            init_dummy_weights(model, seed)
        else:
            model.load_weights(weights)
    return model.eval()


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """Give every meta parameter and buffer uninitialised storage on device,
    and let modules move the constants they computed from the config
    (init_constants(device): rotary frequencies, plain attributes kept in fp32).

    Not nn.Module.to_empty: it makes a new Parameter per module, which unties
    tied weights (lm_head = embed_tokens) and drops the weight_loader
    attribute the loaders call."""
    device = torch.device(device)
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(meta tensor) -> (it, replacement)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in new:
                    m = torch.empty_like(t, device=device)
                    if isinstance(t, nn.Parameter):
                        m = nn.Parameter(m, requires_grad=t.requires_grad)
                        m.__dict__.update(t.__dict__)
                    new[id(t)] = (t, m)
                table[name] = new[id(t)][1]
        if hasattr(module, "init_constants"):
            module.init_constants(device)
    if device.type != "meta":
        stray = [f"{name}.{attr}" if name else attr for name, module in model.named_modules()
                 for attr, v in vars(module).items() if isinstance(v, torch.Tensor) and v.is_meta]
        if stray:
            raise RuntimeError(f"{type(model).__name__}: tensors built on the meta device that no "
                               f"init_constants moved: {', '.join(stray)}")


def init_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> None:
    """load_format "dummy" (vLLM's): every parameter and floating buffer
    uniform in [low, high), drawn on its device from `seed` (same model, seed
    and device: same weights), nothing read from disk.

    A module with init_dummy(generator, low, high) fills its own tensors:
    norms keep their identity scale (RMSNorm 1, Gemma's 1 + w with w = 0), so
    every layer's input has unit RMS as in a trained model, rather than
    shrinking ~1000x per norm to near-constant logits; DeepSeek-V4's router
    draws valid hash routes. Integer tensors need such a method."""
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    for mname, module in model.named_modules():
        own = [(n, t) for n, t in (*module._parameters.items(), *module._buffers.items())
               if t is not None and id(t) not in seen]
        if not own:
            continue
        seen.update(id(t) for _, t in own)
        dev = own[0][1].device
        if dev not in generators:
            generators[dev] = torch.Generator(device=dev).manual_seed(seed)
        g = generators[dev]
        if hasattr(module, "init_dummy"):
            module.init_dummy(g, low, high)
            continue
        for n, t in own:
            if not t.is_floating_point():
                raise ValueError(f"load_format dummy: no dummy values for {mname}.{n} ({t.dtype}); "
                                 f"{type(module).__name__} needs an init_dummy method")
            t.uniform_(low, high, generator=g)


def resident_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold, measured from its tensors: parameters,
    buffers, and what quantized layers store (parallel/quant/base.py)."""
    seen, n = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    for m in model.modules():
        quant = getattr(m, "quant", None)
        if quant is not None and quant.name != "dense" and id(quant) not in seen:   # tied: counted once
            seen.add(id(quant))
            n += quant.nbytes(m)
    return n
