"""Images in a prompt, as the engine core sees them: each a run of
placeholder tokens in the prompt that the model's encoder output replaces.

The front end (server / LLM) decodes and preprocesses an image
(model_zoo/multimodal.py), expands its placeholder and sends the pixels with
the request; the model runner encodes each image once (EncoderCache) when a
prefill chunk first reaches its tokens, and writes the rows in place of the
placeholder embeddings. What the rest of the engine needs from an item:

- the prefix cache must not mistake one image for another: the KV manager
  hashes cache_token_ids, the prompt with each image's placeholders replaced
  by ids derived from the image's content hash (SGLang's trick; negative, so
  no real token matches them);
- a bidirectional span (Gemma 3: an image's tokens see each other) must be
  computed in one chunk: the scheduler never ends a chunk inside one
  (chunk_end), and its tokens get key limits (key_limits).
"""
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import InvalidRequest


@dataclass
class MultiModalItem:
    """One image of a prompt."""
    offset: int                  # its first placeholder token's position in the prompt
    length: int                  # placeholder tokens: the encoder's output rows
    data: torch.Tensor           # what the encoder reads (pixel values [3, S, S])
    hash: str                    # of the image's pixels (prefix cache, encoder cache)
    bidirectional: bool = False  # the span's tokens attend to each other (Gemma 3)

    @property
    def end(self) -> int:
        return self.offset + self.length


def content_hash(data: torch.Tensor) -> str:
    """What identifies an image to the caches: its preprocessed pixels."""
    t = data.detach().contiguous().cpu()
    h = hashlib.blake2b(str((tuple(t.shape), str(t.dtype))).encode(), digest_size=16)
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def check_items(items: list[MultiModalItem], prompt_len: int, max_chunk: int) -> None:
    """ValueError unless the items are ordered, disjoint, inside the prompt,
    and each bidirectional span fits one step's token budget."""
    end = 0
    for it in items:
        if it.length <= 0 or it.offset < end or it.end > prompt_len:
            raise ValueError("multimodal placeholders must be ordered, disjoint runs inside the prompt")
        if it.bidirectional and it.length > max_chunk:
            raise ValueError(f"an image of {it.length} tokens does not fit a step of max_num_batched_tokens "
                             f"{max_chunk}; raise --max-num-batched-tokens")
        end = it.end


def cache_token_ids(token_ids: list[int], items: list[MultiModalItem]) -> list[int]:
    """The prompt as the prefix cache hashes it: each item's placeholders
    replaced by negative ids from its content hash (its position in the run
    included, so a run's blocks differ from each other)."""
    out = list(token_ids)
    for it in items:
        base = int(it.hash[:15], 16)
        out[it.offset:it.end] = [-1 - ((base + j) & ((1 << 62) - 1)) for j in range(it.length)]
    return out


def chunk_end(items: list[MultiModalItem], start: int, end: int) -> int:
    """Where a chunk [start, end) may end: not strictly inside a
    bidirectional span. It stops before a span it would cut, or, starting
    inside one, runs to the span's end (which the scheduler holds back to
    the next step when this step's budget is short of it)."""
    for it in items:
        if it.bidirectional and it.offset < end < it.end:
            return it.offset if it.offset > start else it.end
    return end


def key_limits(items: list[MultiModalItem], start: int, n: int) -> np.ndarray | None:
    """Key limits (kvcache.metadata) of a chunk's tokens [start, start + n):
    a span's tokens see up to its last; None when no span is in the chunk."""
    lim = None
    for it in items:
        if it.bidirectional and it.offset < start + n and it.end > start:
            if lim is None:
                lim = np.arange(start, start + n, dtype=np.int64)
            lim[max(it.offset, start) - start:min(it.end, start + n) - start] = it.end - 1
    return lim


class EncoderCache:
    """The encoder's output per image hash, bounded by count (least recently
    used goes first): an image whose span several chunks or requests share
    is encoded once."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoded = 0          # images encoded (tests, metrics)

    def get(self, item: MultiModalItem, encode) -> torch.Tensor:
        rows = self._rows.get(item.hash)
        if rows is None:
            rows = encode(item.data[None])[0]
            if rows.shape[0] != item.length:
                raise ValueError(f"the encoder gave {rows.shape[0]} rows for {item.length} placeholders")
            self.encoded += 1
            self._rows[item.hash] = rows
            while len(self._rows) > self.capacity:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(item.hash)
        return rows

    def clear(self) -> None:
        self._rows.clear()


class PromptImages:
    """The front end's half (LLM, AsyncLLM): a prompt with images -> its
    token ids with the placeholders expanded, and its items. Prompts as vLLM
    takes them: {"prompt": text, "multi_modal_data": {"image": a PIL image
    or a list}} (the text writes the model's placeholder once per image, as
    its chat template does) or {"prompt_token_ids": [...], ...} (one
    placeholder token per image, or the runs already expanded)."""

    def __init__(self, processor, tokenizer, limit: int | None = None, max_chunk: int = 1 << 62):
        self.processor = processor          # model_zoo.multimodal.ImageProcessor, None: text only
        self.tokenizer = tokenizer
        self.limit = limit                  # images per prompt (--limit-mm-per-prompt), None: no limit
        self.max_chunk = max_chunk          # max_num_batched_tokens: a bidirectional span must fit a step

    def check_count(self, n: int) -> None:
        if n and self.processor is None:
            raise ValueError("this model takes no images (text only)")
        if self.limit is not None and n > self.limit:
            raise ValueError(f"at most {self.limit} image(s) per prompt (--limit-mm-per-prompt), got {n}")

    def encode(self, text: str | None, ids: list[int] | None, images: list) -> tuple[list[int], list[MultiModalItem]]:
        """(ids, items) of a prompt given as text or as token ids, with its
        images (PIL images, in placeholder order)."""
        self.check_count(len(images))
        p = self.processor
        if p is None:
            return ids if ids is not None else self.tokenizer.encode(text), []
        from PIL import Image
        if not all(isinstance(im, (Image.Image, torch.Tensor)) for im in images):
            raise ValueError("images are PIL images (or the processor's pixel tensors)")
        if text is not None:
            ids = self.tokenizer.encode(self.expand_text(text, len(images)))
        elif images and not any(t == p.image_token_id for t in ids):
            ids = p.expand_ids(ids, self.tokenizer)
        spans = p.spans(ids)
        if len(spans) != len(images) or any(n != p.tokens_per_image for _, n in spans):
            raise ValueError(f"the prompt's image tokens make {len(spans)} image(s) of {p.tokens_per_image} "
                             f"tokens; {len(images)} image(s) given")
        items = []
        for (offset, n), image in zip(spans, images):
            data = image if isinstance(image, torch.Tensor) else p.pixels(image)
            items.append(MultiModalItem(offset, n, data, content_hash(data), p.bidirectional))
        check_items(items, len(ids), self.max_chunk)
        return ids, items

    def expand_text(self, text: str, n: int) -> str:
        """A rendered prompt with n images: each of its placeholders expanded
        (ValueError unless it has exactly n)."""
        self.check_count(n)
        p = self.processor
        found = text.count(p.placeholder)
        if found != n:
            raise ValueError(f"the prompt has {found} image placeholder(s) {p.placeholder!r} for {n} image(s)")
        return p.expand(text)

    def from_prompt(self, prompt: dict) -> tuple[str | None, list[int], list[MultiModalItem]]:
        """A vLLM prompt dict -> (text or None, ids, items)."""
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict has `prompt` (text) or `prompt_token_ids`, and `multi_modal_data`")
        data = prompt.get("multi_modal_data") or {}
        if set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes images only, got {sorted(data)}")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError("`prompt` must be a string")
        if text is not None and self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as token ids")
        ids = None if text is not None else [int(t) for t in prompt["prompt_token_ids"]]
        ids, items = self.encode(text, ids, images)
        return text, ids, items

    def encode_prompt(self, prompt: dict, no_images: str | None) -> tuple[str | None, list[int], list[MultiModalItem]]:
        """from_prompt for LLM / AsyncLLM: InvalidRequest on a bad prompt, or
        on images the engine refuses (no_images: ModelInfo's reason)."""
        try:
            text, ids, items = self.from_prompt(prompt)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if items and no_images:
            raise InvalidRequest(no_images)
        return text, ids, items


def chat_images(messages: list[dict]) -> tuple[list[dict], list]:
    """LLM.chat's messages with their images taken out (vLLM's parts:
    {"type": "image_pil", "image_pil": a PIL image} or {"type": "image_url",
    "image_url": {"url": "data:...;base64,..."}}), each replaced by the
    {"type": "image"} part chat templates read; the images in order."""
    out, images = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "image_pil":
                images.append(p["image_pil"])
            elif kind == "image_url":
                images.append(_data_url_image(p.get("image_url")))
            else:
                parts.append(p)
                continue
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, images


def _data_url_image(image_url):
    import base64
    import binascii
    import io

    from PIL import Image
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    head, sep, payload = url.partition(",") if isinstance(url, str) else ("", "", "")
    if not (head.startswith("data:") and head.endswith(";base64") and sep):
        raise InvalidRequest("LLM.chat takes images as data: URLs or image_pil parts (the server fetches others)")
    try:
        im = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        im.load()
        return im
    except (binascii.Error, OSError, ValueError) as e:
        raise InvalidRequest(f"the image data URL cannot be decoded: {e}") from None
