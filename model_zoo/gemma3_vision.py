"""Gemma 3 image input: the vision side of Gemma3ForConditionalGeneration.

Plain torch mirrors of transformers 5.23 (which is a test dependency only):
  - Gemma3VisionEncoder: SiglipVisionModel (models/siglip/modeling_siglip.py)
    followed by Gemma3MultiModalProjector (models/gemma3/modeling_gemma3.py),
    i.e. `Gemma3Model.get_image_features(pixel_values).pooler_output`;
  - preprocess: Gemma3ImageProcessorPil's default path (no pan-and-scan);
  - expand_image_tokens: what Gemma3Processor puts in place of each
    `<start_of_image>` of the rendered prompt.

Config defaults for keys a config.json leaves out are those of
SiglipVisionConfig, Gemma3TextConfig and Gemma3Config.
"""
import re
from collections.abc import Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# SiglipVisionConfig's defaults (a Gemma 3 config.json states most of them).
_VISION_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "vision_use_head": True,
}
_TEXT_HIDDEN_DEFAULT = 2304       # Gemma3TextConfig.hidden_size
_MM_TOKENS_DEFAULT = 256          # Gemma3Config.mm_tokens_per_image

_ACTS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}

# Optional "model." (transformers >= 4.52 saves the multimodal model under it),
# then the tower or the projector; the tower's "vision_model." level is in
# the hub checkpoints and transformers 4 saves, gone from transformers 5 saves.
_NAME = re.compile(r"^(?:model\.)?(?:(vision_tower)\.(?:vision_model\.)?|(multi_modal_projector)\.)(.+)$")


def is_vision_weight(name: str) -> bool:
    """True for a checkpoint tensor of the vision tower or the projector (any spelling)."""
    return _NAME.match(name) is not None


def vision_config(config: Mapping) -> dict:
    """The vision_config with SiglipVisionConfig's defaults filled in."""
    return {**_VISION_DEFAULTS, **(config.get("vision_config") or {})}


def _int_size(v) -> int:
    # SiglipVisionConfig allows [h, w] for image_size / patch_size; Siglip's
    # position table assumes a square grid, so only square is supported.
    if isinstance(v, (list, tuple)):
        if len(set(v)) != 1:
            raise ValueError(f"non-square image/patch size {v} is not supported")
        v = v[0]
    return int(v)


class SiglipAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"vision hidden_size {hidden} not divisible by num_attention_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.q_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        # All patches see each other: no mask, not causal.
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(o.transpose(1, 2).reshape(B, T, -1))


class SiglipMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.act = _ACTS[act]
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        hidden, eps = vc["hidden_size"], vc["layer_norm_eps"]
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = SiglipAttention(hidden, vc["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = SiglipMLP(hidden, vc["intermediate_size"], vc["hidden_act"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(vc) for _ in range(vc["num_hidden_layers"]))


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, vc: dict, image_size: int, patch_size: int):
        super().__init__()
        hidden = vc["hidden_size"]
        self.patch_embedding = nn.Conv2d(vc["num_channels"], hidden, kernel_size=patch_size, stride=patch_size)
        self.position_embedding = nn.Embedding((image_size // patch_size) ** 2, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)
        # position_ids are arange(num_patches): the table itself, in order.
        return x + self.position_embedding.weight


class SiglipVisionTransformer(nn.Module):
    """SiglipVisionModel minus its pooling head (Gemma 3 uses last_hidden_state)."""

    def __init__(self, vc: dict, image_size: int, patch_size: int):
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(vc, image_size, patch_size)
        self.encoder = SiglipEncoder(vc)
        self.post_layernorm = nn.LayerNorm(vc["hidden_size"], eps=vc["layer_norm_eps"])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class _VisionTower(nn.Module):
    # Only there so that parameter names carry the hub's "vision_tower.vision_model." prefix.
    def __init__(self, vc: dict, image_size: int, patch_size: int):
        super().__init__()
        self.vision_model = SiglipVisionTransformer(vc, image_size, patch_size)


class Gemma3RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32, scaled by (1 + w), then cast back: as Gemma3RMSNorm.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, vc: dict, text_hidden: int, patches_per_side: int, tokens_per_side: int):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vc["hidden_size"], text_hidden))
        self.mm_soft_emb_norm = Gemma3RMSNorm(vc["hidden_size"], vc["layer_norm_eps"])
        self.patches_per_side = patches_per_side
        self.kernel = patches_per_side // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, D = x.shape
        g = x.transpose(1, 2).reshape(B, D, self.patches_per_side, self.patches_per_side)
        # Average k x k patches into one soft token, row-major like the patches.
        pooled = F.avg_pool2d(g, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3VisionEncoder(nn.Module):
    """pixel_values [N, 3, S, S] -> image embeddings [N, mm_tokens_per_image, text hidden_size].

    `config` is the checkpoint's whole config.json (a Gemma3Config dict)."""

    def __init__(self, config: Mapping):
        super().__init__()
        vc = vision_config(config)
        if vc["hidden_act"] not in _ACTS:
            raise ValueError(f"unsupported vision hidden_act {vc['hidden_act']!r} (supported: {sorted(_ACTS)})")
        self.image_size = _int_size(vc["image_size"])
        patch_size = _int_size(vc["patch_size"])
        mm_tokens = config.get("mm_tokens_per_image")
        self.num_image_tokens = _MM_TOKENS_DEFAULT if mm_tokens is None else int(mm_tokens)
        text_hidden = (config.get("text_config") or {}).get("hidden_size", _TEXT_HIDDEN_DEFAULT)
        # The projector's geometry, computed as transformers does (int(sqrt), floor divisions);
        # refuse configs where that does not give exactly mm_tokens_per_image tokens.
        patches_per_side = self.image_size // patch_size
        tokens_per_side = int(self.num_image_tokens ** 0.5)
        kernel = patches_per_side // tokens_per_side if tokens_per_side else 0
        if kernel < 1 or (patches_per_side // kernel) ** 2 != self.num_image_tokens:
            raise ValueError(f"mm_tokens_per_image={self.num_image_tokens} does not pool a "
                             f"{patches_per_side}x{patches_per_side} patch grid evenly")
        # SiglipVisionModel's pooling head (vision_use_head, true by default) is
        # computed but discarded by get_image_features: its tensors are skipped.
        self.skip_head = bool(vc["vision_use_head"])
        self.vision_tower = _VisionTower(vc, self.image_size, patch_size)
        self.multi_modal_projector = Gemma3MultiModalProjector(vc, text_hidden, patches_per_side, tokens_per_side)

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.mm_input_projection_weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 4 or pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values must be [N, 3, {self.image_size}, {self.image_size}], "
                             f"got {list(pixel_values.shape)}")
        return self.multi_modal_projector(self.vision_tower.vision_model(pixel_values))

    @staticmethod
    def canonical_name(name: str) -> str | None:
        """A checkpoint name in any spelling -> this module's parameter name (None: not vision)."""
        m = _NAME.match(name)
        if m is None:
            return None
        tower, projector, rest = m.groups()
        return f"vision_tower.vision_model.{rest}" if tower else f"{projector}.{rest}"

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in (cast to each parameter's dtype). Accepts the
        hub spelling (vision_tower.vision_model.*, multi_modal_projector.*), with a
        "model." prefix (transformers 4.52+ saves), and transformers 5's
        (vision_tower.* without vision_model.). Any unknown, duplicate,
        wrong-shape or missing tensor raises ValueError naming it. Returns the
        parameter names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            ours = self.canonical_name(name)
            if ours is not None and self.skip_head and ours.startswith("vision_tower.vision_model.head."):
                continue
            if ours not in params:
                raise ValueError(f"unknown vision weight {name!r}")
            if ours in loaded:
                raise ValueError(f"vision weight {name!r} given twice")
            p = params[ours]
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(f"vision weight {name!r} has shape {list(tensor.shape)}, expected {list(p.shape)}")
            p.copy_(tensor)
            loaded.add(ours)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"missing vision weights: {', '.join(missing)}")
        return loaded


# --- preprocessing (Gemma3ImageProcessorPil, do_pan_and_scan off) ---

def preprocess(image, config: Mapping, processor_config: Mapping | None = None) -> torch.Tensor:
    """A PIL image -> pixel_values [3, S, S] float32, as transformers' Gemma3 image processor.

    config: the checkpoint's config.json (S defaults to vision_config.image_size);
    processor_config: optional preprocessor_config.json, whose size / resample /
    rescale_factor / image_mean / image_std / do_* keys override (null = default)."""
    from PIL import Image

    pc = {k: v for k, v in (processor_config or {}).items() if v is not None}
    size = pc.get("size")
    if size is None:
        h = w = _int_size(vision_config(config)["image_size"])
    elif isinstance(size, Mapping) and "height" in size and "width" in size:
        h, w = int(size["height"]), int(size["width"])
    elif isinstance(size, int):
        h = w = size       # default_to_square
    else:
        raise ValueError(f"unsupported preprocessor size {size!r} (want height/width)")
    # Gemma3ImageProcessor(Pil).resample is BILINEAR (2); the value is a PIL filter id.
    resample = Image.Resampling(int(pc.get("resample", Image.Resampling.BILINEAR)))

    if pc.get("do_convert_rgb", True):
        image = _convert_rgb(image)
    if pc.get("do_resize", True):
        # transformers resizes through PIL, on the uint8 RGB image (same size: a copy).
        image = image.resize((w, h), resample=resample)
    arr = np.array(image)               # a writable copy for torch.from_numpy
    if arr.ndim == 2:                   # an L image left unconverted: one channel
        arr = arr[:, :, None]
    x = torch.from_numpy(arr).permute(2, 0, 1)
    if pc.get("do_rescale", True):
        # transformers: float64 multiply, then float32.
        x = (x.double() * float(pc.get("rescale_factor", 1 / 255))).float()
    else:
        x = x.float()
    if pc.get("do_normalize", True):
        c = x.shape[0]
        mean = _per_channel(pc.get("image_mean", 0.5), c)
        std = _per_channel(pc.get("image_std", 0.5), c)
        x = (x - mean) / std          # float32 throughout, as numpy does it there
    return x.contiguous()


def _per_channel(v, c: int) -> torch.Tensor:
    vals = [float(v)] * c if isinstance(v, (int, float)) else [float(t) for t in v]
    if len(vals) != c:
        raise ValueError(f"image_mean/std must have {c} values, got {vals}")
    return torch.tensor(vals, dtype=torch.float32).view(c, 1, 1)


def _convert_rgb(image):
    """transformers' convert_to_rgb: transparency is composited on white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    return image.convert("RGB")


# --- prompt expansion (Gemma3Processor) ---

BOI_TOKEN = "<start_of_image>"
IMAGE_TOKEN = "<image_soft_token>"
EOI_TOKEN = "<end_of_image>"


def image_token_sequence(num_tokens: int, boi: str = BOI_TOKEN, image_token: str = IMAGE_TOKEN,
                         eoi: str = EOI_TOKEN) -> str:
    """Gemma3Processor.full_image_sequence: the text one image becomes."""
    return f"\n\n{boi}{image_token * num_tokens}{eoi}\n\n"


def expand_image_tokens(text: str, num_tokens: int, boi: str = BOI_TOKEN, image_token: str = IMAGE_TOKEN,
                        eoi: str = EOI_TOKEN) -> str:
    """Each `boi` of the rendered prompt -> "\\n\\n" boi, num_tokens image tokens, eoi "\\n\\n"
    (Gemma3Processor without pan-and-scan: the boi token is the placeholder and stays in)."""
    return text.replace(boi, image_token_sequence(num_tokens, boi, image_token, eoi))


def num_images(text: str, boi: str = BOI_TOKEN) -> int:
    """How many images a rendered prompt asks for (its `boi` placeholders)."""
    return text.count(boi)


__all__ = ["Gemma3VisionEncoder", "is_vision_weight", "vision_config", "preprocess", "expand_image_tokens",
           "image_token_sequence", "num_images", "BOI_TOKEN", "IMAGE_TOKEN", "EOI_TOKEN"]
