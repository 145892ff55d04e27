"""Gemma 4 (text): transformers' Gemma4ForCausalLM (model_type gemma4_text).

Gemma 3's layer (four norms, q/k norms, sliding + full layers, gelu_tanh MLP,
sqrt(hidden) embedding scale, tied head, final soft-capping), and:
  - RMSNorm scales by w, not 1 + w (weights stored as is);
  - values get an RMSNorm too (no scale), and the attention scale is 1;
  - full layers have their own head_dim (global_head_dim, e.g. 512) and,
    with attention_k_eq_v, their own KV-head count and no v_proj: V is K's
    projection before k_norm and RoPE;
  - RoPE per layer type; full layers "proportional": only the first
    partial_rotary_factor of each half-head rotates, the rest gets
    frequency 0 (identity);
  - per-layer inputs (hidden_size_per_layer_input > 0): a second embedding
    [vocab, layers * P] plus a projection of the embeddings give each layer
    a P-vector, gated into the residual after the MLP;
  - KV sharing: the last num_kv_shared_layers layers compute no K/V; each
    reads those of the last earlier layer of its type (its "producer");
  - enable_moe_block: routed experts beside the dense MLP, both normed and
    summed; the expert MLP is gelu_tanh too;
  - every layer ends by scaling the residual by a learned layer_scalar.

Config shapes: transformers >= 5.23 writes the full layers' overrides as
per_layer_config {layer: {head_dim, num_key_value_heads}}; older config.json
files say global_head_dim / num_global_key_value_heads. Both are read.

Tensor parallel: attention and dense MLP as Gemma 3; experts split by id
(model_zoo.fused_moe); router and per-layer-input projections replicated.

GGUF blocks kept as stored (`--quantization gguf`, use_stored): the q/k/v
(only the parts a layer has: q and k in K = V layers, q in KV-shared ones, as
the file has them) and o projections, the MLP, the router's projection when
the file quantizes it, the routed experts (ffn_gate_up_exps split into its
gate and up rows, GGUFExperts), the per-layer-input embedding and
projections, and the embedding (with the tied head). llama.cpp's converter
changes none of these in value; norms, router scales and layer_scalar stay
dense.
"""
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.attention import Attention
from kvcache.dense_cache import expand_kv
from kvcache.spec import LayerSpec
from model_zoo.fused_moe import RoutedExperts
from model_zoo.gemma3 import Gemma3MLP
from model_zoo.layers import (PACKED, RotaryEmbedding, language_model_weights, load_packed_weights, rope_inv_freq,
                              rounded_to, soft_cap, use_gguf_blocks)
from parallel.linear import (ParallelLMHead, QKVParallelLinear, ReplicatedLinear, RowParallelLinear,
                             VocabParallelEmbedding)
from parallel.state import all_reduce

SLIDING, FULL = "sliding_attention", "full_attention"

# transformers' defaults (configuration_gemma4.Gemma4TextConfig) for keys a config.json may omit.
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


# ---------------------------------------------------------------- config

def layer_types(config: dict) -> list[str]:
    n = config["num_hidden_layers"]
    types = list(config.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    types[-1] = FULL        # transformers forces it (with a warning)
    return types


def layer_shapes(config: dict) -> list[tuple[int, int]]:
    """(head_dim, num_kv_heads) of each layer."""
    types = layer_types(config)
    head_dim, kv_heads = config.get("head_dim", 256), config.get("num_key_value_heads", 4)
    if config.get("per_layer_config") is not None:
        over = {int(i): o for i, o in config["per_layer_config"].items()}   # keys are zero-padded strings
        for i, o in over.items():
            extra = sorted(set(o) - {"head_dim", "num_key_value_heads"})
            if extra:
                raise ValueError(f"per_layer_config[{i}]: unsupported keys {extra}")
    else:
        full = {"head_dim": config.get("global_head_dim", 512)}
        # As transformers: the global KV-head count applies only with attention_k_eq_v.
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = config["num_global_key_value_heads"]
        over = {i: full for i, t in enumerate(types) if t == FULL}
    return [(over.get(i, {}).get("head_dim", head_dim), over.get(i, {}).get("num_key_value_heads", kv_heads))
            for i in range(len(types))]


def kv_producers(config: dict) -> list[int | None]:
    """For each layer, the layer whose K/V it reads (None: its own)."""
    types = layer_types(config)
    first = len(types) - config.get("num_kv_shared_layers", 0)
    last = {t: i for i, t in enumerate(types[:first])}
    if any(t not in last for t in types[first:]):
        raise ValueError("num_kv_shared_layers: a shared layer's type has no earlier layer to read K/V from")
    return [None if i < first else last[t] for i, t in enumerate(types)]


def rope_inv_freq_gemma4(head_dim: int, rope: dict) -> torch.Tensor:
    """transformers' "proportional" RoPE: partial_rotary_factor of the head_dim / 2
    frequencies as usual (exponents over the whole head_dim), the rest 0; / factor."""
    if rope.get("rope_type", "default") != "proportional":
        return rope_inv_freq(head_dim, rope)
    angles = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exps = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = torch.cat((1.0 / rope["rope_theta"] ** exps, torch.zeros(head_dim // 2 - angles, device="cpu")))
    return inv_freq / rope.get("factor", 1.0)


# ---------------------------------------------------------------- blocks

class Gemma4RMSNorm(nn.Module):
    """Normalise in fp32 (x * mean(x^2)^-0.5, pow as transformers), scale by w in
    fp32, cast back; with_scale False: no weight (value and router norms)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if with_scale else None

    def init_dummy(self, generator, low, high):
        if self.weight is not None:
            self.weight.fill_(1.0)      # identity scale (models.init_dummy_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            xf = xf * self.weight.float()
        return xf.to(x.dtype)


class Gemma4Rotary(RotaryEmbedding):
    """RotaryEmbedding with Gemma 4's proportional rope; rotates any number of tensors."""

    def __init__(self, head_dim: int, rope: dict):
        nn.Module.__init__(self)
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq_gemma4(head_dim, rope)

    def forward(self, positions, *xs):
        cos, sin = self._cos_sin(positions, xs[0].dtype)
        return tuple(self._rotate(x, cos, sin) for x in xs)


class QKVParts(QKVParallelLinear):
    """QKVParallelLinear holding only some of q, k, v: ("q", "k") for K = V
    layers, ("q",) for KV-shared ones. load_weights feeds the absent parts
    as None (load_packed_weights expects all three); they are skipped."""

    def __init__(self, hidden: int, head_dim: int, heads: int, kv_heads: int, parts: tuple[str, ...], bias: bool):
        super().__init__(hidden, head_dim, heads, kv_heads, bias)
        self.parts = parts
        rows = self.q_size + self.kv_size * (len(parts) - 1)
        self.weight = nn.Parameter(torch.empty(rows, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(rows), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    @property
    def absent(self) -> list[str]:
        return [p for p in ("q", "k", "v") if p not in self.parts]

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id in self.parts:
            super().weight_loader(param, loaded_weight, shard_id)
        elif loaded_weight is not None:
            raise ValueError(f"this layer has no {shard_id}_proj (K = V or KV-shared)")

    def split(self, qkv):
        return qkv.split([self.q_size] + [self.kv_size] * (len(self.parts) - 1), dim=-1)


class SharedKVAttention(nn.Module):
    """Attention of a KV-shared layer over its producer's K/V: with a cache, the
    producer's storage (written earlier this step); without, the producer's
    K/V of this forward. Deliberately not a kvcache Attention:
    KV calibration (engine/kv_calibration.py) hooks those by layer index and
    must see the producer's own q/k/v only."""

    def __init__(self, num_heads: int, head_dim: int, producer: int, sliding_window: int | None):
        super().__init__()
        self.num_heads, self.head_dim, self.producer = num_heads, head_dim, producer
        self.sliding_window = sliding_window
        self.scale = 1.0

    def forward(self, q, kv, meta):
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        if meta is not None:
            return meta.kv_caches[self.producer].attention(q, meta, self.scale).reshape(T, -1)
        k, v = (x.view(T, -1, self.head_dim) for x in kv)
        pos = torch.arange(T, device=q.device)
        mask = pos[None, :] <= pos[:, None]
        if self.sliding_window is not None:
            mask &= pos[None, :] > pos[:, None] - self.sliding_window
        k, v = expand_kv(k, self.num_heads), expand_kv(v, self.num_heads)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1).reshape(T, -1)


class Gemma4Attention(nn.Module):
    def __init__(self, config: dict, layer_idx: int, layer_type: str, head_dim: int, kv_heads: int,
                 producer: int | None, stores: bool, rope: Gemma4Rotary):
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        bias = config.get("attention_bias", False)
        eps = config.get("rms_norm_eps", 1e-6)
        window = config.get("sliding_window", 512) if layer_type == SLIDING else None
        self.layer_type, self.head_dim, self.stores = layer_type, head_dim, stores
        self.shared = producer is not None
        self.k_eq_v = bool(config.get("attention_k_eq_v")) and layer_type == FULL
        parts = ("q",) if self.shared else ("q", "k") if self.k_eq_v else ("q", "k", "v")
        self.qkv_proj = QKVParts(hidden, head_dim, heads, kv_heads, parts, bias)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=bias)
        self.q_norm = Gemma4RMSNorm(head_dim, eps)
        self.rotary_emb = rope
        nh, nkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        if self.shared:
            self.attn = SharedKVAttention(nh, head_dim, producer, window)
        else:
            self.k_norm = Gemma4RMSNorm(head_dim, eps)
            self.v_norm = Gemma4RMSNorm(head_dim, eps, with_scale=False)
            self.attn = Attention(nh, nkv, head_dim, 1.0, layer_idx, window)

    def forward(self, positions, x, attn_metadata, shared_kv: dict):
        T, D = x.shape[0], self.head_dim
        parts = self.qkv_proj.split(self.qkv_proj(x))
        q = self.q_norm(parts[0].view(T, -1, D)).view(T, -1)
        if self.shared:
            (q,) = self.rotary_emb(positions, q)
            return self.o_proj(self.attn(q, shared_kv.get(self.layer_type), attn_metadata))
        k = parts[1]
        v = k if self.k_eq_v else parts[2]      # K = V: values are the raw key projection
        k = self.k_norm(k.view(T, -1, D)).view(T, -1)
        v = self.v_norm(v.view(T, -1, D)).view(T, -1)
        q, k = self.rotary_emb(positions, q, k)
        if self.stores:
            shared_kv[self.layer_type] = (k, v)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class Gemma4Router(nn.Module):
    """Norm (no weight) * scale / sqrt(hidden) -> proj -> fp32 softmax over all
    experts -> top k, renormalised, times each chosen expert's per_expert_scale."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k_experts {top_k} must be in [1, num_experts = {num_experts}]")
        self.top_k, self.root = top_k, hidden ** -0.5
        self.norm = Gemma4RMSNorm(hidden, eps, with_scale=False)
        self.proj = ReplicatedLinear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)

    def init_dummy(self, generator, low, high):
        self.scale.fill_(1.0)
        self.per_expert_scale.fill_(1.0)

    def forward(self, x):   # [T, H] -> expert ids [T, k], weights [T, k] (fp32, as transformers)
        h = self.norm(x) * self.scale * self.root
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return idx, w * self.per_expert_scale[idx]


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_idx: int, layer_type: str, shape: tuple[int, int],
                 producer: int | None, stores: bool, rope: Gemma4Rotary):
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("rms_norm_eps", 1e-6)
        self.self_attn = Gemma4Attention(config, layer_idx, layer_type, *shape, producer, stores, rope)
        inter = config["intermediate_size"]
        if config.get("use_double_wide_mlp") and producer is not None:
            inter *= 2
        self.mlp = Gemma3MLP(hidden, inter)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)   # a buffer in transformers
        self.moe = bool(config.get("enable_moe_block"))
        if self.moe:
            self.router = Gemma4Router(hidden, config["num_experts"], config["top_k_experts"], eps)
            self.experts = RoutedExperts(config["num_experts"], hidden, config["moe_intermediate_size"],
                                         act="gelu_tanh")
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.per_layer = config.get("hidden_size_per_layer_input", 256)
        if self.per_layer:
            self.per_layer_input_gate = ReplicatedLinear(hidden, self.per_layer, bias=False)
            self.per_layer_projection = ReplicatedLinear(self.per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def init_dummy(self, generator, low, high):
        self.layer_scalar.fill_(1.0)

    def forward(self, positions, x, attn_metadata, per_layer_input, shared_kv):
        h = self.self_attn(positions, self.input_layernorm(x), attn_metadata, shared_kv)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            # The experts read the layer's MLP input before its norm, the router too.
            idx, w = self.router(x)
            e = all_reduce(self.experts(self.pre_feedforward_layernorm_2(x), idx, w))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(e)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer:
            h = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden, n = config["hidden_size"], config["num_hidden_layers"]
        eps = config.get("rms_norm_eps", 1e-6)
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], hidden)
        self.embed_scale = hidden ** 0.5
        types, shapes, producers = layer_types(config), layer_shapes(config), kv_producers(config)
        rope_params = config.get("rope_parameters") or DEFAULT_ROPE
        # RoPE per type, over that type's head_dim (transformers: per_layer_config[type]).
        ropes = {t: Gemma4Rotary(shapes[types.index(t)][0], rope_params.get(t) or DEFAULT_ROPE[t])
                 for t in set(types)}
        stores = {p for p in producers if p is not None}
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, i, t, shapes[i], producers[i], i in stores, ropes[t])
            for i, t in enumerate(types))
        self.norm = Gemma4RMSNorm(hidden, eps)
        self.per_layer = config.get("hidden_size_per_layer_input", 256)
        if self.per_layer:
            self.embed_tokens_per_layer = VocabParallelEmbedding(
                config.get("vocab_size_per_layer_input", 262_144), n * self.per_layer)
            self.per_layer_model_projection = ReplicatedLinear(hidden, n * self.per_layer, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer, eps)

    def _per_layer_inputs(self, input_ids, x):
        """[T, layers, P]: the token's own per-layer embedding plus a projection
        of its (scaled) main embedding, normed, averaged with 1/sqrt(2)."""
        T, P = x.shape[0], self.per_layer
        tok = self.embed_tokens_per_layer(input_ids)
        tok = (tok * rounded_to(P ** 0.5, tok.dtype)).view(T, -1, P)
        proj = (self.per_layer_model_projection(x) * x.shape[-1] ** -0.5).view(T, -1, P)
        return (self.per_layer_projection_norm(proj) + tok) * 2.0 ** -0.5

    def forward(self, input_ids, positions, attn_metadata):
        x = self.embed_tokens(input_ids)
        # The scale rounded to the weight dtype first, as transformers does.
        x = x * rounded_to(self.embed_scale, x.dtype)
        per_layer = self._per_layer_inputs(input_ids, x) if self.per_layer else None
        shared_kv: dict = {}     # layer type -> producer's (k, v) of this forward
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, attn_metadata, per_layer[:, i] if per_layer is not None else None, shared_kv)
        return self.norm(x)


class Gemma4ForCausalLM(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {act!r} (supported: gelu_pytorch_tanh)")
        if config.get("use_bidirectional_attention") == "all":
            raise ValueError("Gemma4 use_bidirectional_attention 'all' is not supported (causal LM only)")
        self.config = config
        self.final_logit_softcapping = config.get("final_logit_softcapping")
        self.model = Gemma4Model(config)
        self.tie_word_embeddings = config.get("tie_word_embeddings", True)
        self.lm_head = ParallelLMHead(config["vocab_size"], config["hidden_size"])
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(hidden).float(), self.final_logit_softcapping)

    _ATTN_TENSOR = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|k_norm|v_norm)\.(\w+)$")

    def _complete(self, weights):
        """Checkpoint tensors as load_packed_weights wants them: KV-shared layers'
        k/v projections and norms dropped (checkpoints may hold them;
        transformers ignores them too), and None for the q/k/v parts a layer
        lacks (K = V, KV-shared), which QKVParts skips."""
        layers = self.model.layers
        for name, t in weights:
            m = self._ATTN_TENSOR.match(name)
            if m and int(m[1]) < len(layers):
                attn = layers[int(m[1])].self_attn
                if attn.shared and m[2] != "q_proj":
                    continue
                if m[2] == "q_proj":
                    for p in attn.qkv_proj.absent:
                        yield f"model.layers.{m[1]}.self_attn.{p}_proj.{m[3]}", None
            yield name, t

    def use_stored(self, fmts: dict[str, str]) -> int:
        """Layers fed by these checkpoint tensors keep their GGUF rows (call on the meta-built model)."""
        n = use_gguf_blocks(self, fmts, PACKED)
        if self.tie_word_embeddings:       # the head reads the embedding's storage
            self.lm_head.weight, self.lm_head.quant = self.model.embed_tokens.weight, self.model.embed_tokens.quant
        return n

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # lm_head.weight with tied embeddings: the same tensor as embed_tokens.
        ignore = ("lm_head.weight",) if self.tie_word_embeddings else ()
        # A multimodal checkpoint (Gemma4ForConditionalGeneration): its language model only.
        towers = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
        load_packed_weights(self, self._complete(language_model_weights(weights, towers, [])), PACKED, ignore)

    def kv_cache_spec(self) -> list[LayerSpec]:
        """The layers that store K/V; KV-shared layers (always the last ones) read their producer's."""
        return [LayerSpec(layer.self_attn.attn.layer_idx, layer.self_attn.attn.num_kv_heads,
                          layer.self_attn.head_dim, layer.self_attn.attn.sliding_window)
                for layer in self.model.layers if not layer.self_attn.shared]
