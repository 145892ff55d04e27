"""Llama, Qwen2 and Qwen3: one decoder, three sets of flags.

  llama  q/k/v/o bias from `attention_bias`, MLP bias from `mlp_bias`
  qwen2  bias on q/k/v (always), none on o_proj; optional sliding-window layers
  qwen3  per-head RMSNorm on q and k before RoPE; head_dim from config (default 128)

Module names mirror transformers' checkpoint names (model.layers.N.self_attn...),
except that q/k/v and gate/up are fused; load_weights does the mapping.
"""
from collections.abc import Iterable

import torch
from torch import nn

from kvcache.attention import Attention
from kvcache.spec import LayerSpec
from model_zoo.layers import (PACKED, RMSNorm, RotaryEmbedding, SiluAndMul, load_packed_weights,
                              rope_parameters, use_gguf_blocks)
from parallel.linear import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                             RowParallelLinear, VocabParallelEmbedding)


class LlamaAttention(nn.Module):
    def __init__(self, config: dict, layer_idx: int, head_dim: int, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, rope: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        hidden = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        self.head_dim = head_dim
        self.rotary_emb = rope
        if qk_norm:
            eps = config.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              head_dim ** -0.5, layer_idx, sliding_window)

    def forward(self, positions, x, attn_metadata):
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.qk_norm:
            # Norm over each head's vector, not over the whole projection.
            T = x.shape[0]
            q = self.q_norm(q.view(T, -1, self.head_dim)).view(T, -1)
            k = self.k_norm(k.view(T, -1, self.head_dim)).view(T, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str):
        super().__init__()
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (supported: silu)")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_idx: int, attn: LlamaAttention, mlp: nn.Module):
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)

    def forward(self, positions, x, attn_metadata):
        x = x + self.self_attn(positions, self.input_layernorm(x), attn_metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: dict, layers: list[LlamaDecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, attn_metadata):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, attn_metadata)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    # Per-family switches; Qwen2/Qwen3 override them below.
    qkv_bias: bool | None = None     # None: follow config["attention_bias"]
    o_bias: bool | None = None
    qk_norm = False
    default_head_dim: int | None = None   # None: hidden_size // num_attention_heads
    has_sliding_layers = False

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        hidden = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or self.default_head_dim or hidden // num_heads
        attention_bias = config.get("attention_bias", False)
        qkv_bias = attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = attention_bias if self.o_bias is None else self.o_bias
        # Llama-style configs use mlp_bias; Qwen configs have no such key (False).
        mlp_bias = config.get("mlp_bias", False)

        # One rotary module shared by all layers: they all use the same frequencies.
        rope = self.rotary = RotaryEmbedding(head_dim, rope_parameters(config))
        self.sliding_windows = self._sliding_windows(config)
        self.head_dim = head_dim
        layers = []
        for i in range(config["num_hidden_layers"]):
            attn = LlamaAttention(config, i, head_dim, qkv_bias, o_bias, self.qk_norm, rope,
                                  self.sliding_windows[i])
            layers.append(LlamaDecoderLayer(config, i, attn, self._mlp(config, i, mlp_bias)))
        self.model = LlamaModel(config, layers)
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)
        self.lm_head = ParallelLMHead(config["vocab_size"], hidden)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _mlp(self, config: dict, layer_idx: int, bias: bool) -> nn.Module:
        return LlamaMLP(config["hidden_size"], config["intermediate_size"], bias, config.get("hidden_act", "silu"))

    def _sliding_windows(self, config: dict) -> list[int | None]:
        n = config["num_hidden_layers"]
        if not self.has_sliding_layers:
            return [None] * n
        # Qwen2/3: sliding window only when use_sliding_window, and then (unless
        # layer_types says otherwise) on layers >= max_window_layers.
        window = config.get("sliding_window", 4096) if config.get("use_sliding_window", False) else None
        types = config.get("layer_types") or [
            "sliding_attention" if window is not None and i >= config.get("max_window_layers", 28)
            else "full_attention" for i in range(n)]
        return [window if t == "sliding_attention" else None for t in types]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        self.rotary.begin(positions)
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # rotary_emb.inv_freq: a buffer some old checkpoints saved; recomputed here.
        # lm_head.weight with tied embeddings: the same tensor as embed_tokens.
        ignore = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tie_word_embeddings else ())
        load_packed_weights(self, weights, PACKED, ignore)

    def use_stored(self, fmts: dict[str, str]) -> int:
        """Layers fed by these checkpoint tensors keep their GGUF rows (call on the meta-built model)."""
        n = use_gguf_blocks(self, fmts, PACKED)
        if self.tie_word_embeddings:       # the head reads the embedding's storage
            self.lm_head.weight, self.lm_head.quant = self.model.embed_tokens.weight, self.model.embed_tokens.quant
        return n

    def kv_cache_spec(self) -> list[LayerSpec]:
        return [LayerSpec(layer.self_attn.attn.layer_idx, layer.self_attn.attn.num_kv_heads,
                          self.head_dim, layer.self_attn.attn.sliding_window)
                for layer in self.model.layers]


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
    has_sliding_layers = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    default_head_dim = 128
    has_sliding_layers = True
