"""Gemma 3 (text): transformers' Gemma3ForCausalLM (model_type gemma3_text).

What sets it apart from llama:
  - RMSNorm scales by (1 + w), in fp32;
  - four norms per layer: the attention and MLP outputs are normed again
    before they join the residual stream;
  - per-head RMSNorm on q and k before RoPE;
  - most layers use a sliding window (layer_types, or 5 of every
    `sliding_window_pattern` = 6), with their own RoPE base (local 1e4 vs
    global 1e6, the global one possibly linearly scaled);
  - embeddings multiplied by sqrt(hidden_size), rounded to the weight dtype;
  - attention scale query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
  - gelu (tanh approximation) gated MLP; tied embeddings.
"""
from collections.abc import Iterable

import torch
from torch import nn

from kvcache.attention import Attention
from kvcache.spec import LayerSpec
from model_zoo.layers import (PACKED, GeluAndMul, GemmaRMSNorm, RotaryEmbedding, load_packed_weights, rounded_to,
                              soft_cap, use_gguf_blocks)
from parallel.linear import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                             RowParallelLinear, VocabParallelEmbedding)

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config: dict) -> list[str]:
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])
    pattern = config.get("sliding_window_pattern", 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


def rope_parameters(config: dict) -> dict[str, dict]:
    """{layer type: rope dict}, from transformers 5's nested `rope_parameters`
    or the older rope_theta / rope_local_base_freq / rope_scaling keys (the
    scaling applies to global layers only, as in transformers)."""
    nested = config.get("rope_parameters") or {}
    full = dict(nested.get(FULL) or {"rope_type": "default"})
    if config.get("rope_scaling"):
        full.update(config["rope_scaling"])
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    sliding = dict(nested.get(SLIDING) or {"rope_type": "default"})
    sliding.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    return {FULL: full, SLIDING: sliding}


class Gemma3Attention(nn.Module):
    def __init__(self, config: dict, layer_idx: int, rope: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        hidden = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads", 4)
        head_dim = config.get("head_dim", 256)
        bias = config.get("attention_bias", False)
        eps = config.get("rms_norm_eps", 1e-6)
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=bias)
        self.q_norm = GemmaRMSNorm(head_dim, eps)
        self.k_norm = GemmaRMSNorm(head_dim, eps)
        self.rotary_emb = rope
        scale = config.get("query_pre_attn_scalar", 256) ** -0.5
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              scale, layer_idx, sliding_window)

    def forward(self, positions, x, attn_metadata):
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = self.q_norm(q.view(T, -1, self.head_dim)).view(T, -1)
        k = self.k_norm(k.view(T, -1, self.head_dim)).view(T, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class Gemma3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2)
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act = GeluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_idx: int, rope: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = Gemma3Attention(config, layer_idx, rope, sliding_window)
        self.mlp = Gemma3MLP(hidden, config["intermediate_size"])
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions, x, attn_metadata):
        h = self.self_attn(positions, self.input_layernorm(x), attn_metadata)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], hidden)
        self.embed_scale = hidden ** 0.5
        ropes = {t: RotaryEmbedding(config.get("head_dim", 256), p) for t, p in rope_parameters(config).items()}
        self.ropes = list(ropes.values())
        window = config.get("sliding_window", 4096)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, ropes[t], window if t == SLIDING else None)
            for i, t in enumerate(layer_types(config)))
        self.norm = GemmaRMSNorm(hidden, config.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, attn_metadata, mm_embeds=None):
        for rope in self.ropes:
            rope.begin(positions)
        x = self.embed_tokens(input_ids)
        # transformers rounds the scale to the weight dtype first (sqrt(640) in
        # bf16 is 25.25, not 25.298); match it.
        x = x * rounded_to(self.embed_scale, x.dtype)
        if mm_embeds is not None:       # image rows replace their placeholders, unscaled
            rows, e = mm_embeds
            x = x.index_copy(0, rows, e.to(x.dtype))
        for layer in self.layers:
            x = layer(positions, x, attn_metadata)
        return self.norm(x)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {act!r} (supported: gelu_pytorch_tanh)")
        if config.get("attn_logit_softcapping") is not None:
            raise ValueError("Gemma3 attn_logit_softcapping is not supported by the attention backend")
        if config.get("use_bidirectional_attention"):
            raise ValueError("Gemma3 use_bidirectional_attention is not supported (causal LM only)")
        if len(layer_types(config)) != config["num_hidden_layers"]:
            raise ValueError("layer_types must have num_hidden_layers entries")
        self.config = config
        self.final_logit_softcapping = config.get("final_logit_softcapping")
        self.model = Gemma3Model(config)
        self.tie_word_embeddings = config.get("tie_word_embeddings", True)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"])
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(hidden).float(), self.final_logit_softcapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # lm_head.weight with tied embeddings: the same tensor as embed_tokens.
        ignore = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_packed_weights(self, weights, PACKED, ignore)

    def use_stored(self, fmts: dict[str, str]) -> int:
        """Layers fed by these checkpoint tensors keep their GGUF rows (call on the meta-built model)."""
        n = use_gguf_blocks(self, fmts, PACKED)
        if self.tie_word_embeddings:       # the head reads the embedding's storage
            self.lm_head.weight, self.lm_head.quant = self.model.embed_tokens.weight, self.model.embed_tokens.quant
        return n

    def kv_cache_spec(self) -> list[LayerSpec]:
        return [LayerSpec(layer.self_attn.attn.layer_idx, layer.self_attn.attn.num_kv_heads,
                          layer.self_attn.head_dim, layer.self_attn.attn.sliding_window)
                for layer in self.model.layers]


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 with its SigLIP vision tower (gemma-3-4b/12b/27b): images in,
    text out. The language model is Gemma3ForCausalLM's; an image's
    <image_soft_token> placeholders take the encoder's rows
    (model_zoo/gemma3_vision.py) after the embedding scale, as transformers'
    Gemma3Model does, and attend to each other bidirectionally (the engine's
    key limits)."""
    # Transformers' token_type_ids mask: an image's tokens see the whole image.
    mm_bidirectional = True

    def __init__(self, config: dict):
        from model_zoo.gemma3_vision import Gemma3VisionEncoder
        super().__init__(config)
        outer = config.get("multimodal_config") or {}
        self.vision = Gemma3VisionEncoder({**outer, "text_config": config})
        self.image_token_id = int(outer.get("image_token_index", outer.get("image_token_id", 262144)))

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, mm_tokens_per_image, hidden]."""
        w = self.vision.multi_modal_projector.mm_input_projection_weight
        return self.vision(pixel_values.to(w.device, w.dtype, non_blocking=True))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """mm_embeds: (rows [N], embeddings [N, hidden]) of the step's image placeholders."""
        if self.image_token_id >= self.config["vocab_size"]:
            # A placeholder id past the text vocabulary (transformers reads id 0 there).
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        return self.model(input_ids, positions, attn_metadata, mm_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from model_zoo.gemma3_vision import is_vision_weight
        vision: list[tuple[str, torch.Tensor]] = []

        def text(ws):
            for name, t in ws:
                if is_vision_weight(name):
                    vision.append((name, t))
                    continue
                for old, new in _MM_TEXT_NAMES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                yield name, t
        # The tower's parameters come through vision (its own load checks them).
        ignore = ("lm_head.weight",) if self.tie_word_embeddings else ()
        load_packed_weights(self, text(weights), PACKED, ignore, optional=("vision.",))
        self.vision.load_weights(vision)


# The language model's tensors in a multimodal checkpoint: transformers 5's
# spelling, then the hub files' (language_model.model.*).
_MM_TEXT_NAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
