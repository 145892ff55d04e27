"""Images named by chat requests, fetched and decoded before the prompt is
built: `data:` URLs (base64), http(s) URLs (vLLM's VLLM_IMAGE_FETCH_TIMEOUT,
default 5 s; at most MAX_IMAGE_BYTES), and file:// URLs under
--allowed-local-media-path only (vLLM's rule: no path otherwise). A URL that
cannot be read or an image that cannot be decoded is a 400 naming the part."""
import asyncio
import base64
import binascii
import io
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from server.errors import APIError

MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_PIXELS = 64 << 20        # decoded size; PIL's own bomb check warns only above 89M


def fetch_timeout() -> float:
    return float(os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5"))


async def load_images(state, messages, param: str | None = None) -> int:
    """Decode and preprocess every image part of `messages` onto the part
    (its `_image`: the model's pixel tensor);
    returns how many. 400s (param: the request field they name; default
    messages.{i}): a model that takes no images, too many images
    (--limit-mm-per-prompt), a URL that cannot be read, bytes that are no image."""
    parts = [(param or f"messages.{i}", p) for i, m in enumerate(messages) for p in m.images()]
    if not parts:
        return 0
    _check(state, len(parts), parts[0][0])
    root = state.config.allowed_local_media_path
    data = await asyncio.gather(*(_read(p.image_url.url, root, where) for where, p in parts))
    loop = asyncio.get_running_loop()
    pixels = state.llm.images.processor.pixels
    for (where, p), raw in zip(parts, data):
        # Decoded and preprocessed off the event loop (a large image takes tens of ms).
        p._image = await loop.run_in_executor(None, lambda: pixels(_decode(raw, where)))
    return len(parts)


async def load_base64_images(state, datas: list[str], param: str) -> list:
    """llama.cpp's multimodal_data (base64, or data: URLs) -> the model's
    pixel tensors, with load_images' checks and 400s."""
    if datas:
        _check(state, len(datas), param)
    loop = asyncio.get_running_loop()
    pixels = state.llm.images.processor.pixels if datas else None
    out = []
    for d in datas:
        raw = await _read(d if d.startswith("data:") else "data:;base64," + d, None, param)
        out.append(await loop.run_in_executor(None, lambda: pixels(_decode(raw, param))))
    return out


def _check(state, n: int, param: str) -> None:
    """400 unless the model takes n images (a model without images, --limit-mm-per-prompt, a KV cache
    whose attention cannot run image spans)."""
    try:
        state.llm.images.check_count(n)
    except ValueError as e:
        raise APIError(400, f"image inputs: {e}", param=param) from None
    if state.llm.no_images:
        raise APIError(400, f"image inputs: {state.llm.no_images}", param=param)


async def _read(url: str, root: str | None, param: str) -> bytes:
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise APIError(400, "an image data URL must be data:<type>;base64,<data>", param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, "the image data URL is not valid base64", param=param) from None
    if scheme in ("http", "https"):
        try:
            async with httpx.AsyncClient(timeout=fetch_timeout(), follow_redirects=True) as client:
                async with client.stream("GET", url) as r:
                    if r.status_code != 200:
                        raise APIError(400, f"fetching the image {url} answered HTTP {r.status_code}", param=param)
                    body = bytearray()
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_IMAGE_BYTES:
                            raise APIError(400, f"the image {url} is over {MAX_IMAGE_BYTES >> 20} MiB", param=param)
                    return bytes(body)
        except httpx.HTTPError as e:
            raise APIError(400, f"the image {url} could not be fetched: {type(e).__name__}", param=param) from None
    if scheme == "file":
        if not root:
            raise APIError(400, "file:// image URLs need the server's --allowed-local-media-path", param=param)
        path = Path(unquote(urlparse(url).path)).resolve()
        if not path.is_relative_to(Path(root).resolve()):
            raise APIError(400, "the image path is outside --allowed-local-media-path", param=param)
        try:
            if path.stat().st_size > MAX_IMAGE_BYTES:
                raise APIError(400, f"the image is over {MAX_IMAGE_BYTES >> 20} MiB", param=param)
            return path.read_bytes()
        except OSError as e:
            raise APIError(400, f"the image file cannot be read: {e.strerror}", param=param) from None
    raise APIError(400, "an image URL is data:, http(s):// or file://", param=param)


def _decode(raw: bytes, param: str):
    from PIL import Image
    try:
        im = Image.open(io.BytesIO(raw))
        if im.width * im.height > MAX_IMAGE_PIXELS:
            raise APIError(400, f"the image is {im.width} x {im.height} pixels, over {MAX_IMAGE_PIXELS >> 20}M",
                           param=param)
        im.load()
        return im
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise APIError(400, f"the image cannot be decoded: {e}", param=param) from None
