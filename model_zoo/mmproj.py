"""llama.cpp's --mmproj: a vision tower in a GGUF file of its own
(general.architecture "clip", written by llama.cpp's converter from a
Gemma3ForConditionalGeneration checkpoint) joined to a Gemma 3 GGUF
language model, so the pair serves images as the Hugging Face checkpoint
does (model_zoo/gemma3_vision.py).

The file's names are gguf-py's (TensorNameMap for MODEL_ARCH.MMPROJ), its
hyperparameters the clip.vision.* keys; the converter stores the
projector's Gemma RMSNorm weight as w + 1 (undone here) and the SigLIP
tensors as they are."""
from itertools import chain
from pathlib import Path

import gguf
import numpy as np
import torch

from model_zoo.source import ModelLoadError, ModelSource

# clip.projector_type -> the checkpoint class the pair runs as
PROJECTORS = {"gemma3": "Gemma3ForConditionalGeneration"}
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def read_mmproj(path: str | Path) -> tuple[dict, list[tuple[str, object]]]:
    """(the multimodal config keys a Gemma3Config has, [(checkpoint name,
    GGUF tensor)] of the tower and projector)."""
    from model_zoo.gemma3_vision import Gemma3VisionEncoder
    from model_zoo.gguf_loader import open_reader
    path = Path(path)
    reader = open_reader(path)
    meta = reader.metadata
    if meta.get("general.architecture") != "clip":
        raise ModelLoadError(f"{path}: not a multimodal projector (general.architecture "
                             f"{meta.get('general.architecture')!r}, not 'clip')")
    kind = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if kind not in PROJECTORS:
        raise ModelLoadError(f"{path}: projector type {kind!r} is not supported (supported: {', '.join(PROJECTORS)})")

    def key(name, default=None):
        v = meta.get(f"clip.vision.{name}", default)
        if v is None:
            raise ModelLoadError(f"{path}: clip.vision.{name} is missing")
        return v
    image_size, patch = int(key("image_size")), int(key("patch_size"))
    per_side = image_size // patch // int(key("projector.scale_factor", 4))
    vision = {"hidden_size": int(key("embedding_length")), "intermediate_size": int(key("feed_forward_length")),
              "num_hidden_layers": int(key("block_count")), "num_attention_heads": int(key("attention.head_count")),
              "layer_norm_eps": float(key("attention.layer_norm_epsilon", 1e-6)), "image_size": image_size,
              "patch_size": patch, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}
    outer = {"vision_config": vision, "mm_tokens_per_image": per_side * per_side,
             "processor_config": {"image_mean": [float(x) for x in key("image_mean", [0.5] * 3)],
                                  "image_std": [float(x) for x in key("image_std", [0.5] * 3)]}}
    # The file's names from the tower's own parameter names, as the converter maps them.
    with torch.device("meta"):
        params = dict(Gemma3VisionEncoder({**outer, "text_config": {"hidden_size": 1}}).named_parameters())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    ours = {}
    for p in params:
        stem, suffix = p.replace("_weight", ".weight").rsplit(".", 1)
        ours[f"{names.get_name(stem)}.{suffix}"] = p
    tensors = {t.name: t for t in reader.tensors}
    missing = sorted(set(ours) - set(tensors))
    if missing:
        raise ModelLoadError(f"{path}: missing {len(missing)} vision tensors, first {missing[0]}")
    return outer, [(ours[n], tensors[n]) for n in ours]


def _dense(name: str, t, path: Path) -> torch.Tensor:
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read tensor {t.name} ({t.tensor_type.name}): {e}") from e
    arr = np.asarray(arr, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
    if name.endswith("mm_soft_emb_norm.weight"):
        arr = arr - 1.0             # stored as w + 1 (llama.cpp's converter)
    return torch.from_numpy(np.array(arr, copy=True))


def attach_mmproj(source: ModelSource, path: str | Path) -> None:
    """Make a Gemma 3 GGUF source the multimodal model: its config names
    Gemma3ForConditionalGeneration with the projector's vision config and the
    tokenizer's image token ids, and every weight stream ends with the
    tower's tensors (read from the file as they are needed)."""
    path = Path(path)
    if source.format != "gguf" or source.config.get("model_type") != "gemma3_text":
        raise ModelLoadError("--mmproj goes with a Gemma 3 GGUF language model")
    outer, tensors = read_mmproj(path)
    tok = source.tokenizer
    ids = [tok.backend.token_to_id(t) if tok is not None else None for t in IMAGE_TOKENS]
    if None in ids:
        raise ModelLoadError(f"{source.path}: its tokenizer lacks Gemma 3's image tokens ({', '.join(IMAGE_TOKENS)})")
    boi, eoi, image = ids
    source.config = {**source.config, "architectures": [PROJECTORS["gemma3"]], "multimodal_config": {
        **outer, "boi_token_index": boi, "eoi_token_index": eoi, "image_token_index": image}}

    def vision(meta: bool = False):
        for name, t in tensors:
            if meta:
                yield name, torch.empty(tuple(int(d) for d in reversed(t.shape.tolist())), device="meta")
            else:
                yield name, _dense(name, t, path)

    for attr, meta in (("_weights_fn", False), ("_stored_fn", False), ("_stored_meta_fn", True)):
        fn = getattr(source, attr)
        if fn is not None:
            setattr(source, attr, lambda fn=fn, meta=meta: chain(fn(), vision(meta)))
    source.num_tensors += len(tensors)
