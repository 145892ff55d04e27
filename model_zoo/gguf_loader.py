"""Open a .gguf file as a ModelSource: HF config, tokenizer, chat template,
stop ids, and HF-named float32 weights dequantized one tensor at a time.

What llama.cpp's converter changed, and is undone here (as transformers'
modeling_gguf_pytorch_utils does):
- names: GGUF `blk.N.attn_q.weight` style; inverted from gguf's own
  TensorNameMap over the HF names each architecture has;
- llama only: q_proj/k_proj rows are permuted (interleaved rotary halves ->
  llama.cpp's rope layout); reversed per head (k with the KV head count);
- gemma3: every `*norm.weight` is stored as w+1 (HF Gemma3RMSNorm computes
  x*(1+w)), so 1 is subtracted, including q_norm/k_norm and the final norm;
- tied embeddings: no `output.weight` in the file means lm_head is the
  embedding; no lm_head tensor is emitted and tie_word_embeddings=True.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from model_zoo.chat_template import FALLBACK_TEMPLATES
from model_zoo.source import ModelLoadError, ModelSource
from model_zoo.tokenizer import Tokenizer, TokenizerError, gguf_metadata

try:
    import gguf
    from gguf import GGMLQuantizationType as Q
except ImportError as e:  # pragma: no cover - gguf is a hard dependency
    raise ImportError("model_zoo.gguf_loader needs the `gguf` package") from e


# Types this loader dequantizes (with gguf.quants.dequantize, numpy). The brief
# set plus the other k-quants that common Q*_K_M / Q*_K_S files mix in.
SUPPORTED_TYPES = frozenset(
    getattr(Q, name)
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
    if hasattr(Q, name)
)

# GGUF general.architecture -> facts about the HF model it becomes.
ARCHS = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rope_theta": 1000000.0},
    "gemma3": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1000000.0},
    "qwen3moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "rope_theta": 1000000.0},
}

_LAYER_PARAMS = {
    "base": [
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    ],
    "qwen2": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "qwen3": ["self_attn.q_norm.weight", "self_attn.k_norm.weight"],
    "qwen3moe": ["self_attn.q_norm.weight", "self_attn.k_norm.weight"],
    "gemma3": [
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
    ],
}

# Token texts llama.cpp treats as end-of-generation when they are control
# tokens (llama-vocab.cpp); chat models stop on these, not only on `eos`.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
})


# Every layer's MLP: dense, or (MoE archs, all layers sparse in llama.cpp) the router and the
# experts as one [E, ...] tensor per projection (ffn_*_exps).
_MLP = {"dense": ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"],
        "qwen3moe": ["mlp.gate.weight", "mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight",
                     "mlp.experts.down_proj.weight"]}
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_param_names(arch: str, num_layers: int) -> list[str]:
    """Every parameter name the HF model for `arch` has (lm_head included)."""
    per_layer = _LAYER_PARAMS["base"] + _LAYER_PARAMS.get(arch, []) + _MLP.get(arch, _MLP["dense"])
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.{p}" for p in per_layer]
    return names


def gguf_to_hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF name, by inverting gguf's own HF -> GGUF TensorNameMap."""
    arch_enum = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_enum is None:
        raise ModelLoadError(f"gguf package does not know architecture {arch!r}")
    name_map = gguf.get_tensor_name_map(arch_enum, num_layers)
    out = {}
    for hf_name in hf_param_names(arch, num_layers):
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_stem = name_map.get_name(stem)
        if gguf_stem is None:
            raise ModelLoadError(f"no GGUF name for {hf_name} in gguf's {arch} tensor map")
        out[f"{gguf_stem}.{suffix}"] = hf_name
    return out


def reverse_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert `permute` of q/k rows: (head, 2, d/2) -> (head, d/2, 2) back."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta_get(meta: dict, arch: str, key: str, default=None):
    return meta.get(f"{arch}.{key}", default)


def build_config(meta: dict, tensor_names: set[str], path: Path) -> dict:
    """HF config.json-shaped dict from GGUF metadata.

    Key names and meanings follow transformers' config classes (v5:
    `rope_parameters`), plus flat `rope_theta` (and gemma3
    `rope_local_base_freq`) so model code need not parse rope_parameters.
    """
    arch = meta["general.architecture"]
    facts = ARCHS[arch]

    def need(key: str):
        value = _meta_get(meta, arch, key)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = _meta_get(meta, arch, "attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # some files store one count per layer
        kv_heads = max(kv_heads)
    layers = int(need("block_count"))
    head_dim = _meta_get(meta, arch, "attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = _meta_get(meta, arch, "rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // heads
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = _meta_get(meta, arch, "vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab_size is None:
        raise ModelLoadError(f"{path}: GGUF states no {arch}.vocab_size and has no tokenizer.ggml.tokens")
    rope_theta = float(_meta_get(meta, arch, "rope.freq_base", facts["rope_theta"]))

    config: dict = {
        "model_type": facts["model_type"],
        "architectures": list(facts["architectures"]),
        "hidden_size": hidden,
        "intermediate_size": int(need("expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "vocab_size": int(vocab_size),
        "max_position_embeddings": int(_meta_get(meta, arch, "context_length", 2048)),
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if meta.get("tokenizer.ggml.unknown_token_id") is not None:
        config["unk_token_id"] = meta["tokenizer.ggml.unknown_token_id"]

    rope_scaling = _rope_scaling(meta, arch)
    if arch == "gemma3":
        # llama.cpp hardcodes what Gemma 3 GGUFs do not state: local rope base
        # 10k, every 6th layer global, and the query scale 1/sqrt(head_dim)
        # except on 27B (62 layers), which uses hidden/heads.
        local_base = float(_meta_get(meta, arch, "rope.freq_base_swa", 10000.0))
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(_meta_get(meta, arch, "attention.sliding_window", 4096)),
            layer_types=_gemma3_layer_types(meta, arch, layers),
            rope_local_base_freq=local_base,
            query_pre_attn_scalar=(hidden // heads) if layers == 62 else head_dim,
            final_logit_softcapping=_meta_get(meta, arch, "final_logit_softcapping"),
            attn_logit_softcapping=_meta_get(meta, arch, "attn_logit_softcapping"),
            attention_bias=False,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
                "full_attention": {**(rope_scaling or {"rope_type": "default"}), "rope_theta": rope_theta},
            },
        )
    else:
        config["rope_parameters"] = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": rope_theta}
        config["hidden_act"] = "silu"
        if arch in ("llama", "qwen3", "qwen3moe"):
            config["attention_bias"] = False
        if arch == "qwen3moe":
            # llama.cpp: every layer routed, top-k weights renormalised (its norm_w = true)
            config.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                          moe_intermediate_size=int(need("expert_feed_forward_length")), norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[])
        if arch == "llama":
            config["mlp_bias"] = False
    return config


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    kind = _meta_get(meta, arch, "rope.scaling.type")
    factor = _meta_get(meta, arch, "rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 0, 1.0):
        return None
    out = {"rope_type": kind, "factor": float(factor)}
    original = _meta_get(meta, arch, "rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = int(original)
    return out


def _gemma3_layer_types(meta: dict, arch: str, layers: int) -> list[str]:
    pattern = _meta_get(meta, arch, "attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one flag per layer, true = sliding
        return ["sliding_attention" if p else "full_attention" for p in pattern][:layers]
    pattern = int(pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def eos_ids(meta: dict, tokenizer: Tokenizer | None) -> list[int]:
    """GGUF eos, then eot/eom, then control tokens llama.cpp treats as end-of-generation."""
    out: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is not None and value >= 0 and value not in out:
            out.append(int(value))
    if tokenizer is not None:
        for text in sorted(EOG_TEXTS):
            idx = tokenizer.backend.token_to_id(text)
            if idx is not None and idx in tokenizer.all_special_ids and idx not in out:
                out.append(idx)
    return out


def _open_reader(path: Path) -> "gguf.GGUFReader":
    if not path.exists():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"GGUF path {path} is not a file")
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad files
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {t.name} needs bytes {t.data_offset}..{t.data_offset + t.n_bytes}, "
                f"file has {size}"
            )
    return reader


def open_gguf(path: str | Path) -> ModelSource:
    path = Path(path)
    reader = _open_reader(path)
    # Vocab arrays are needed whole for the tokenizer; everything else is small.
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHS))})"
        )

    tensors = {t.name: t for t in reader.tensors}
    config = build_config(meta, set(tensors), path)
    layers = config["num_hidden_layers"]
    to_hf = gguf_to_hf_names(arch, layers)

    plan = []  # (gguf tensor, hf name), in file order
    for name, t in tensors.items():
        hf = to_hf.get(name)
        if hf is None:
            if name == "rope_freqs.weight":
                raise ModelLoadError(
                    f"{path}: has rope_freqs.weight (llama3-style rope scaling), which this loader does not support"
                )
            raise ModelLoadError(f"{path}: tensor {name} has no Hugging Face name for architecture {arch}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {name} has quant type {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
            )
        plan.append((t, hf))
    present = {hf for _, hf in plan}
    missing = [hf for hf in to_hf.values() if hf not in present and hf != "lm_head.weight"]
    if missing:
        inverse = {v: k for k, v in to_hf.items()}
        raise ModelLoadError(
            f"{path}: missing {len(missing)} tensors, first {inverse[missing[0]]} ({missing[0]})"
        )

    try:
        tokenizer = Tokenizer.from_gguf(meta) if "tokenizer.ggml.tokens" in meta else None
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    chat_template = meta.get("tokenizer.chat_template") or FALLBACK_TEMPLATES.get(arch)

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permute = arch == "llama"
    norm_offset = arch == "gemma3"

    from parallel.quant.base import QuantizedTensor
    from parallel.quant.gguf import qtype_name
    # Linear weights in a type the GGUF kernels take: kept as stored with --quantization gguf.
    # Routed experts stay stacked ([E, rows, row bytes]) as parallel.quant.base.GGUFExperts holds them.
    blocks = {hf: qtype_name(int(t.tensor_type)) for t, hf in plan
              if hf.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight"))
              and qtype_name(int(t.tensor_type))}

    def permuted(arr: np.ndarray, name: str) -> np.ndarray:
        # Rows are output features, dense or blocks alike.
        if permute and name.endswith("attn_q.weight"):
            return reverse_llama_permute(arr, heads)
        if permute and name.endswith("attn_k.weight"):
            return reverse_llama_permute(arr, kv_heads)
        return arr

    def gguf_blocks() -> Iterator[tuple[str, object]]:
        for t, hf in plan:
            if hf not in blocks:
                yield from dense(t, hf)
                continue
            if _STACKED_EXPERTS.match(hf):      # [E, rows, row bytes]
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                raw = np.asarray(t.data).reshape(shape[0], shape[1], -1)
                yield hf, QuantizedTensor(blocks[hf], torch.from_numpy(raw.copy()), shape)
                continue
            raw = np.ascontiguousarray(permuted(np.asarray(t.data).reshape(int(t.shape[1]), -1), t.name))
            yield hf, QuantizedTensor(blocks[hf], torch.from_numpy(raw.copy()),
                                      (int(t.shape[1]), int(t.shape[0])))

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for t, hf in plan:
            yield from dense(t, hf)

    def dense(t, hf: str) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            arr = arr.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        except Exception as e:
            raise ModelLoadError(
                f"{path}: cannot dequantize tensor {t.name} ({t.tensor_type.name}): {type(e).__name__}: {e}"
            ) from e
        arr = permuted(arr, t.name)
        if norm_offset and t.name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)
        if arr.dtype != np.float32 or not arr.flags.writeable or not arr.flags.c_contiguous:
            # F32 tensors are views into the read-only memmap: copy those only
            arr = np.array(arr, dtype=np.float32, copy=True, order="C")
        stacked = _STACKED_EXPERTS.match(hf)
        if stacked:     # [E, ...] -> one tensor per expert, as HF checkpoints name them
            for e in range(arr.shape[0]):
                yield f"{stacked[1]}.{e}.{stacked[2]}.weight", torch.from_numpy(arr[e])
        else:
            yield hf, torch.from_numpy(arr)

    return ModelSource(
        path=path,
        format="gguf",
        config=config,
        tokenizer=tokenizer,
        chat_template=chat_template,
        eos_token_ids=eos_ids(meta, tokenizer),
        _weights_fn=weights,
        # what the streams yield: stacked experts come one expert at a time
        num_tensors=sum(int(t.shape[-1]) if _STACKED_EXPERTS.match(hf) else 1 for t, hf in plan),
        stored=blocks,
        _stored_fn=gguf_blocks,
    )
