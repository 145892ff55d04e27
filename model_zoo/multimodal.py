"""What the front end needs to put a model's images into a prompt: the
placeholder a prompt writes per image, how the placeholder expands, the
pixels, and where the placeholder tokens land. One class per model family,
looked up by architecture (image_processor_for)."""
import json
from pathlib import Path

import torch


class ImageProcessor:
    """Images for one checkpoint. Subclasses set placeholder (the text a
    prompt or chat template writes per image), image_token_id (the token
    the encoder's rows replace), tokens_per_image and bidirectional."""
    placeholder: str
    image_token_id: int
    tokens_per_image: int
    bidirectional: bool = False

    def pixels(self, image) -> torch.Tensor:
        """A PIL image -> what the model's encoder reads."""
        raise NotImplementedError

    def expand(self, text: str) -> str:
        """The prompt text with each placeholder expanded as the model's
        processor does (before tokenizing)."""
        raise NotImplementedError

    def expand_ids(self, ids: list[int], tokenizer) -> list[int]:
        """A token prompt whose placeholders are not expanded yet (one
        placeholder token per image), expanded in token space."""
        raise NotImplementedError

    def spans(self, ids: list[int]) -> list[tuple[int, int]]:
        """(offset, length) of each run of image tokens, in order; a run
        longer than one image is several images back to back."""
        out, i, n, t = [], 0, len(ids), self.image_token_id
        while i < n:
            if ids[i] != t:
                i += 1
                continue
            j = i
            while j < n and ids[j] == t:
                j += 1
            for a in range(i, j, self.tokens_per_image):
                out.append((a, min(self.tokens_per_image, j - a)))
            i = j
        return out


class Gemma3Images(ImageProcessor):
    """Gemma3ForConditionalGeneration (transformers' Gemma3Processor, no pan-and-scan)."""
    bidirectional = True

    def __init__(self, config: dict, folder: Path | None):
        from model_zoo import gemma3_vision as gv
        self._gv = gv
        self.outer = config.get("multimodal_config") or {}
        # A Hugging Face directory's preprocessor_config.json, or an mmproj file's mean / std.
        self.processor_config = _read_json(folder, "preprocessor_config.json") or self.outer.get("processor_config")
        self.placeholder = gv.BOI_TOKEN
        self.image_token_id = int(self.outer.get("image_token_index", self.outer.get("image_token_id", 262144)))
        self.tokens_per_image = int(self.outer.get("mm_tokens_per_image", 256))

    def pixels(self, image) -> torch.Tensor:
        return self._gv.preprocess(image, self.outer, self.processor_config)

    def expand(self, text: str) -> str:
        return self._gv.expand_image_tokens(text, self.tokens_per_image)

    def expand_ids(self, ids: list[int], tokenizer) -> list[int]:
        boi = int(self.outer.get("boi_token_index", 255999))
        if tokenizer is None:
            raise ValueError("a token prompt with images needs the model's tokenizer to expand them")
        seq = tokenizer.encode(self._gv.image_token_sequence(self.tokens_per_image), add_special_tokens=False)
        out: list[int] = []
        for t in ids:
            out.extend(seq if t == boi else (t,))
        return out


_PROCESSORS = {"Gemma3ForConditionalGeneration": Gemma3Images}


def image_processor_for(config: dict, folder: str | Path | None = None) -> ImageProcessor | None:
    """The checkpoint's image processor, or None for a text-only model."""
    archs = config.get("architectures") or []
    cls = _PROCESSORS.get(archs[0]) if archs else None
    return None if cls is None else cls(config, Path(folder) if folder else None)


def _read_json(folder: Path | None, name: str) -> dict | None:
    if folder is None or not folder.is_dir() or not (folder / name).is_file():
        return None
    with open(folder / name) as f:
        return json.load(f)
