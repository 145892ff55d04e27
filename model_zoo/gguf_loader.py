"""Open a .gguf file as a ModelSource: HF config, tokenizer, chat template,
stop ids, and HF-named float32 weights dequantized one tensor at a time.

What llama.cpp's converter (convert_hf_to_gguf.py / conversion/*.py) changed,
and is undone here (as transformers' modeling_gguf_pytorch_utils does):
- names: GGUF `blk.N.attn_q.weight` style; inverted from gguf's own
  TensorNameMap over the HF names each architecture has, after the renames
  the converter makes before mapping (below);
- llama only: q_proj/k_proj rows are permuted (interleaved rotary halves ->
  llama.cpp's rope layout); reversed per head (k with the KV head count);
- gemma3: every `*norm.weight` is stored as w+1 (HF Gemma3RMSNorm computes
  x*(1+w)), so 1 is subtracted, including q_norm/k_norm and the final norm;
- qwen3next / qwen35 / qwen35moe (Qwen3NextModel.modify_tensors and
  _LinearAttentionVReorderBase): every `*norm.weight` but the DeltaNet output
  norm (linear_attn.norm) is stored as w+1; A_log as ssm_a = -exp(A_log);
  dt_bias renamed dt_proj.bias (ssm_dt.bias); the conv1d kernel squeezed
  [C, 1, K] -> [C, K]; qwen3next's in_proj_qkvz (grouped per key head:
  [q, k, v, z] each) split into attn_qkv ([q of all heads, k..., v...]) and
  attn_gate (z); Qwen3.5, when value heads outnumber key heads, has its value
  heads reordered from grouped by key head to tiled (v0 of every key head,
  then v1, ...) in in_proj_qkv's v rows, in_proj_z, in_proj_b/a, A_log,
  dt_bias, the conv1d v channels and out_proj's columns;
- qwen35 / qwen35moe MTP head (_Qwen35MtpMixin): with
  `<arch>.nextn_predict_layers` 1 the block count includes it, as block
  N = the main layers' count; its decoder layer `mtp.layers.0.*` is written
  as `model.layers.N.*` (so blk.N.attn_q ... like a main full-attention
  layer, same transforms), and mtp.fc / pre_fc_norm_embedding /
  pre_fc_norm_hidden / norm as blk.N.nextn.eh_proj / enorm / hnorm /
  shared_head_norm. eh_proj keeps fc's [embedding, hidden] input order (no
  transform); the three norms' converter-side names (model.layers.N.enorm /
  hnorm / shared_head.norm.weight) end in `norm.weight`, so like every
  (1 + w) norm they are stored as w+1. Loaded back as `mtp.*`, with mtp_num_hidden_layers 1 and
  num_hidden_layers excluding the block (llama.cpp's Qwen3NextModel writes
  no MTP block for qwen3next; one there would load the same way). More
  than one nextn layer is not supported: those blocks are skipped;
- gemma4 (Gemma4Model): norms as they are (w, not w+1); router.scale stored
  as ffn_gate_inp.scale, router.per_expert_scale as ffn_down_exps.scale,
  layer_scalar as layer_output_scale.weight; the full layers' proportional
  RoPE written as rope_freqs (1 for the rotated frequencies, 1e30 for the
  rest), from which partial_rotary_factor is read back;
- routed experts: one [E, ...] tensor per projection (ffn_*_exps), or gate
  and up fused (ffn_gate_up_exps, [gate; up] rows: always for gemma4);
- tied embeddings: no `output.weight` in the file means lm_head is the
  embedding; no lm_head tensor is emitted and tie_word_embeddings=True.

Kept as stored (`--quantization gguf`, ModelSource.stored and the stored
stream): the linear and embedding weights in a GGUF kernel type
(_BLOCK_TENSORS), as uint8 rows. Of the transforms above, only those that
move whole rows are undone on them (llama's q/k permute, Qwen3.5's value-head
reorder of in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; fused gate + up
experts split into their two halves of rows); qwen3next's qkvz comes as the
file's two tensors (the model takes that layout), and Qwen3.5's out_proj,
whose value heads are reordered along its columns, comes as stored (the
model reorders its input to match). Everything the converter changed in
value (w + 1 norms, ssm_a, squeezed conv) is a small dense tensor.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from model_zoo import generation_config as gen_config, pooler_config as pool_config
from model_zoo.chat_template import FALLBACK_TEMPLATES
from model_zoo.source import ModelLoadError, ModelSource, optional_config
from model_zoo.gguf_file import GGUFFile
from model_zoo.tokenizer import Tokenizer, TokenizerError

try:
    import gguf
    from gguf import GGMLQuantizationType as Q
except ImportError as e:  # pragma: no cover - gguf is a hard dependency
    raise ImportError("model_zoo.gguf_loader needs the `gguf` package") from e

log = logging.getLogger("tqserve.gguf")


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
    "qwen3next": {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "rope_theta": 10000.0},
    "qwen35": {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "rope_theta": 10000.0},
    "qwen35moe": {"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
                  "rope_theta": 10000.0},
    "gemma4": {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "rope_theta": 1000000.0},
}
HYBRID_QWEN = ("qwen3next", "qwen35", "qwen35moe")
MOE_ARCHS = ("qwen3moe", "qwen3next", "qwen35moe")
# Architectures whose models keep GGUF rows as stored (use_stored, --quantization gguf).
_BLOCKS_ARCHS = frozenset({"llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "gemma4"} | set(HYBRID_QWEN))
# HF names (their ends) of the tensors that feed a linear or embedding layer: those in a GGUF
# kernel type keep their rows with --quantization gguf. Norms, routers (ffn_gate_inp, F32 in
# llama.cpp's files), Qwen's one-row shared_expert_gate, the DeltaNet conv kernel, A_log and
# dt_bias, Gemma 4's scales: dense (small; most carry a transform undone in float).
_BLOCK_TENSORS = (
    "proj.weight", "embed_tokens.weight", "lm_head.weight",
    # DeltaNet input projections (qwen3next's in_proj_qkvz as the file splits it: _stored_parts)
    "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_ba.weight",
    "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
    "mtp.fc.weight",                                            # the MTP head's eh_proj
    # Gemma 4's per-layer inputs
    "embed_tokens_per_layer.weight", "per_layer_model_projection.weight", "per_layer_input_gate.weight",
    "per_layer_projection.weight",
)

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
                     "mlp.experts.down_proj.weight"],
        "shared": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                   "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"]}
# Stacked experts [E, ...]; gate_up_proj: gate and up fused ([E, 2I, H], ffn_gate_up_exps).
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj|gate_up_proj)\.weight$")

# HF names llama.cpp's converter renames before mapping them: HF suffix -> (the name it
# maps, the suffix of the GGUF name).
_RENAMED = {
    "linear_attn.dt_bias": ("linear_attn.dt_proj", ".bias"),       # blk.N.ssm_dt.bias
    "linear_attn.A_log": ("linear_attn.A_log", ""),                 # blk.N.ssm_a, no .weight
    "layer_scalar": ("layer_scalar", ".weight"),                    # blk.N.layer_output_scale.weight
    "router.scale": ("router.proj", ".scale"),                      # blk.N.ffn_gate_inp.scale
    "router.per_expert_scale": ("experts.down_proj", ".scale"),     # blk.N.ffn_down_exps.scale
}
# HF tensors llama.cpp writes as two: qwen3next's in_proj_qkvz as attn_qkv + attn_gate.
_SPLIT = {"linear_attn.in_proj_qkvz.weight": ("attn_qkv.weight", "attn_gate.weight")}
# Tensors llama.cpp treats as optional (default 1), present in every file its converter writes.
_OPTIONAL = ("layer_scalar",)


def _qwen_layer_params(arch: str, config: dict, i: int) -> list[str]:
    p = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if config["layer_types"][i] == "full_attention":
        p += [f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    else:
        proj = ("in_proj_qkvz", "in_proj_ba") if arch == "qwen3next" else \
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        p += [f"linear_attn.{x}.weight" for x in (*proj, "conv1d", "norm", "out_proj")]
        p += ["linear_attn.dt_bias", "linear_attn.A_log"]
    return p + (_MLP["dense"] if arch == "qwen35" else _MLP["qwen3moe"] + _MLP["shared"])


def _gemma4_layer_params(config: dict, i: int) -> list[str]:
    full = config["layer_types"][i] == "full_attention"
    shared = i >= config["num_hidden_layers"] - config["num_kv_shared_layers"]
    proj = ["q_proj", "o_proj"] + ([] if shared else ["k_proj"] if full and config["attention_k_eq_v"]
                                   else ["k_proj", "v_proj"])
    p = [f"self_attn.{x}.weight" for x in proj] + ["self_attn.q_norm.weight"]
    p += [f"self_attn.{x}.bias" for x in proj if config["attention_bias"]]
    p += [] if shared else ["self_attn.k_norm.weight"]
    p += [f"{x}.weight" for x in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                  "post_feedforward_layernorm")]
    p += _MLP["dense"] + ["layer_scalar"]
    if config["enable_moe_block"]:
        p += ["router.proj.weight", "router.scale", "router.per_expert_scale", "experts.gate_proj.weight",
              "experts.up_proj.weight", "experts.down_proj.weight", "pre_feedforward_layernorm_2.weight",
              "post_feedforward_layernorm_1.weight", "post_feedforward_layernorm_2.weight"]
    if config["hidden_size_per_layer_input"]:
        p += ["per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight"]
    return p


# The MTP head's own tensors: HF name -> llama.cpp's NEXTN tensor (_Qwen35MtpMixin's remapper).
_MTP_NEXTN = {"mtp.fc.weight": gguf.MODEL_TENSOR.NEXTN_EH_PROJ,
              "mtp.pre_fc_norm_embedding.weight": gguf.MODEL_TENSOR.NEXTN_ENORM,
              "mtp.pre_fc_norm_hidden.weight": gguf.MODEL_TENSOR.NEXTN_HNORM,
              "mtp.norm.weight": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM}

_MTP_PRE_FC_NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")


def _mtp_param_names(arch: str, config: dict) -> list[str]:
    """The MTP head's HF names (mtp_num_hidden_layers 1): its full-attention layer and its own tensors."""
    if not config.get("mtp_num_hidden_layers"):
        return []
    full = dict(config, layer_types=["full_attention"])
    return list(_MTP_NEXTN) + [f"mtp.layers.0.{p}" for p in _qwen_layer_params(arch, full, 0)]


def hf_param_names(arch: str, config: dict) -> list[str]:
    """Every parameter name the HF model for `arch` has (lm_head and an MTP
    head included); routed experts as one stacked name per projection."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    if arch == "gemma4" and config["hidden_size_per_layer_input"]:
        names += ["model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
                  "model.per_layer_projection_norm.weight"]
    for i in range(config["num_hidden_layers"]):
        if arch in HYBRID_QWEN:
            per_layer = _qwen_layer_params(arch, config, i)
        elif arch == "gemma4":
            per_layer = _gemma4_layer_params(config, i)
        else:
            per_layer = _LAYER_PARAMS["base"] + _LAYER_PARAMS.get(arch, []) + _MLP.get(arch, _MLP["dense"])
        names += [f"model.layers.{i}.{p}" for p in per_layer]
    return names + (_mtp_param_names(arch, config) if arch in HYBRID_QWEN else [])


def gguf_to_hf_names(arch: str, config: dict) -> dict[str, str]:
    """GGUF tensor name -> HF name, by inverting gguf's own HF -> GGUF TensorNameMap.
    Stacked gate and up experts may also come fused: ffn_gate_up_exps -> `experts.gate_up_proj.weight`."""
    arch_enum = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_enum is None:
        raise ModelLoadError(f"gguf package does not know architecture {arch!r}")
    n_mtp = int(config.get("mtp_num_hidden_layers", 0))
    name_map = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"] + n_mtp)
    out = {}
    for hf_name in hf_param_names(arch, config):
        if hf_name in _MTP_NEXTN:
            out[gguf.TENSOR_NAMES[_MTP_NEXTN[hf_name]].format(bid=config["num_hidden_layers"]) + ".weight"] = hf_name
            continue
        # the MTP layer is mapped as the converter names it: the block after the main layers
        mapped = hf_name.replace("mtp.layers.0.", f"model.layers.{config['num_hidden_layers']}.", 1)
        prefix, _, rest = mapped.partition(".layers.")
        bid, _, sub = rest.partition(".")
        if sub in _SPLIT:
            for part in _SPLIT[sub]:
                out[f"blk.{bid}.{part}"] = hf_name
            continue
        if sub in _RENAMED:
            stem, suffix = f"{prefix}.layers.{bid}.{_RENAMED[sub][0]}", _RENAMED[sub][1]
        else:
            stem, suffix = mapped.rsplit(".", 1)
            suffix = "." + suffix
        stacked = _STACKED_EXPERTS.match(mapped)
        gguf_stem = name_map.get_name(stem)
        if gguf_stem is not None:
            out[gguf_stem + suffix] = hf_name
        elif not (stacked and stacked[2] in ("gate_proj", "up_proj")):     # gemma4's map: only fused
            raise ModelLoadError(f"no GGUF name for {hf_name} in gguf's {arch} tensor map")
        if stacked and stacked[2] == "gate_proj":
            fused = name_map.get_name(f"{stacked[1]}.gate_up_proj")
            if fused is not None:
                out[f"{fused}.weight"] = hf_name.replace(".gate_proj.weight", ".gate_up_proj.weight")
    return out


def reverse_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert `permute` of q/k rows: (head, 2, d/2) -> (head, d/2, 2) back."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def untile_v_heads(a: np.ndarray, axis: int, num_k_heads: int, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's Qwen3.5 value-head reorder along `axis` (value heads of
    head_dim each): tiled (v0 of every key head, then v1, ...) -> grouped by key head."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    per_k = shape[0] // head_dim // num_k_heads
    a = a.reshape(per_k, num_k_heads, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(a, 0, axis)


def merge_qkvz(qkv: np.ndarray, z: np.ndarray, config: dict) -> np.ndarray:
    """qwen3next's in_proj_qkvz back from attn_qkv ([q of all key heads, k..., v...])
    and attn_gate (z): rows grouped per key head as [q, k, v, z]."""
    nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
    parts = [x.reshape(nk, -1, x.shape[-1]) for x in (q, k, v, z)]
    return np.concatenate(parts, axis=1).reshape(-1, qkv.shape[-1])


def _qwen_undo(arch: str, config: dict):
    """The value transforms of llama.cpp's Qwen3NextModel (and Qwen3.5's V reorder), undone.
    rows_only: `a` is a projection's GGUF rows (uint8 [rows, row bytes]): only the row
    reorders apply (whole rows move, exact on blocks); out_proj's value-head reorder is
    over its columns, inside the blocks, so its rows come as stored (the model tiles
    out_proj's input instead: model_zoo/qwen3_next.py SplitProjectionDeltaNet)."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    tiled = arch != "qwen3next" and nk != nv

    def undo(hf: str, a: np.ndarray, rows_only: bool = False) -> np.ndarray:
        if rows_only:
            leaf = hf.split(".linear_attn.")[-1]
            if ".linear_attn." not in hf or leaf == "out_proj.weight":
                return a        # no transform (the norms and the one-row gate are never blocks)
            if leaf not in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                            "in_proj_ba.weight"):
                raise ValueError(f"{hf}: its GGUF transform cannot be undone on quantized rows")
        if ".linear_attn." not in hf:
            # the MTP head's pre-fc norms too: the converter adds 1 under their GGUF-bound
            # names (model.layers.N.enorm / hnorm.weight), which end in norm.weight
            if hf.endswith("norm.weight") or hf in _MTP_PRE_FC_NORMS:
                return a - np.float32(1.0)
            if hf.endswith("shared_expert_gate.weight"):
                return a.reshape(1, -1)     # [1, H]; older converters squeezed it to [H]
            return a
        leaf = hf.split(".linear_attn.")[1]
        if tiled:
            if leaf == "in_proj_qkv.weight" or leaf == "conv1d.weight":
                a = np.concatenate([a[:2 * nk * dk], untile_v_heads(a[2 * nk * dk:], 0, nk, dv)])
            elif leaf == "in_proj_z.weight":
                a = untile_v_heads(a, 0, nk, dv)
            elif leaf in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
                a = untile_v_heads(a, 0, nk, 1)
            elif leaf == "out_proj.weight":
                a = untile_v_heads(a, 1, nk, dv)
        if leaf == "A_log":
            return np.log(-a)               # stored as ssm_a = -exp(A_log)
        if leaf == "conv1d.weight":
            return a.reshape(a.shape[0], 1, -1)     # stored squeezed [C, K]
        return a

    return undo


def _stored_parts(hf: str, ts: list) -> list[tuple[str, object, int | None]]:
    """What the stored stream yields for HF tensor hf from its GGUF tensor(s) ts: [(name,
    tensor, half)]. qwen3next's in_proj_qkvz as the file's two tensors, named as Qwen3.5's
    split projections: attn_qkv as in_proj_qkv (q, k, v of all heads) and attn_gate as
    in_proj_z (the model takes that layout: qwen3_next.GatedDeltaNet.use_gguf_layout);
    fused gate + up experts (ffn_gate_up_exps, [gate; up] rows of each expert) as
    experts.gate_proj (half 0) and experts.up_proj (half 1). Else hf itself."""
    if len(ts) == 2:
        by_part = {t.name.rsplit(".", 2)[1]: t for t in ts}
        return [(hf.replace("in_proj_qkvz", "in_proj_qkv"), by_part["attn_qkv"], None),
                (hf.replace("in_proj_qkvz", "in_proj_z"), by_part["attn_gate"], None)]
    m = _STACKED_EXPERTS.match(hf)
    if m and m[2] == "gate_up_proj":
        return [(f"{m[1]}.gate_proj.weight", ts[0], 0), (f"{m[1]}.up_proj.weight", ts[0], 1)]
    return [(hf, ts[0], None)]


def _meta_get(meta: dict, arch: str, key: str, default=None):
    return meta.get(f"{arch}.{key}", default)


def _rows(tensors: dict, name: str) -> int | None:
    """Rows of a GGUF tensor as HF shapes it (its last GGUF dimension), or None when absent."""
    t = tensors.get(name)
    return None if t is None else int(t.shape[-1])


def build_config(meta: dict, tensors: dict, path: Path) -> dict:
    """HF config.json-shaped dict from GGUF metadata (and, where llama.cpp reads a
    fact from the tensors, their names and shapes: {name: ReaderTensor}).

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
    if isinstance(kv_heads, list) and arch != "gemma4":  # some files store one count per layer
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
    ffn = _meta_get(meta, arch, "feed_forward_length")
    if arch in MOE_ARCHS:
        ffn = ffn if arch != "qwen3moe" and ffn is not None else need("expert_feed_forward_length")
    elif ffn is None:
        need("feed_forward_length")

    config: dict = {
        "model_type": facts["model_type"],
        "architectures": list(facts["architectures"]),
        "hidden_size": hidden,
        "intermediate_size": ffn if isinstance(ffn, list) else int(ffn),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads if isinstance(kv_heads, list) else int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "vocab_size": int(vocab_size),
        "max_position_embeddings": int(_meta_get(meta, arch, "context_length", 2048)),
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in tensors,
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
    elif arch == "gemma4":
        config.update(_gemma4_config(meta, tensors, path, config, need))
    else:
        config["rope_parameters"] = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": rope_theta}
        config["hidden_act"] = "silu"
        if arch in ("llama", "qwen3", "qwen3moe") + HYBRID_QWEN:
            config["attention_bias"] = False
        if arch in MOE_ARCHS:
            # llama.cpp: every layer routed, top-k weights renormalised (its norm_w = true)
            config.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                          moe_intermediate_size=int(need("expert_feed_forward_length")), norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[])
        if arch in HYBRID_QWEN:
            config.update(_qwen_hybrid_config(meta, tensors, config, need))
        if arch == "llama":
            config["mlp_bias"] = False
    return config


def _qwen_hybrid_config(meta: dict, tensors: dict, config: dict, need) -> dict:
    arch = meta["general.architecture"]
    # The MTP block(s) are appended after the main layers (Qwen3.5's converter).
    n_mtp = int(_meta_get(meta, arch, "nextn_predict_layers", 0))
    layers = config["num_hidden_layers"] - n_mtp
    # llama.cpp: linear attention except every full_attention_interval-th layer, 4 when unstated
    every = int(_meta_get(meta, arch, "full_attention_interval", 4))
    nv = int(need("ssm.time_step_rank"))
    rotary = int(_meta_get(meta, arch, "rope.dimension_count", config["head_dim"]))
    rope = dict(config["rope_parameters"], partial_rotary_factor=rotary / config["head_dim"])
    sections = _meta_get(meta, arch, "rope.dimension_sections")
    if sections is not None:     # Qwen3.5's multimodal rotary; text positions make it the plain one
        rope["mrope_section"] = [int(s) for s in sections if s][:3]
    out = dict(
        num_hidden_layers=layers,
        full_attention_interval=every,
        layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)],
        linear_conv_kernel_dim=int(need("ssm.conv_kernel")),
        linear_key_head_dim=int(need("ssm.state_size")),
        linear_num_key_heads=int(need("ssm.group_count")),
        linear_num_value_heads=nv,
        linear_value_head_dim=int(need("ssm.inner_size")) // nv,
        partial_rotary_factor=rope["partial_rotary_factor"],
        rope_parameters=rope,
    )
    if n_mtp == 1:      # the head the model code loads (`mtp.*`); more nextn layers are skipped
        out["mtp_num_hidden_layers"] = 1
    if arch in MOE_ARCHS:
        shared = (_meta_get(meta, arch, "expert_shared_feed_forward_length")
                  or _rows(tensors, "blk.0.ffn_up_shexp.weight"))
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _gemma4_config(meta: dict, tensors: dict, path: Path, config: dict, need) -> dict:
    arch, layers = "gemma4", config["num_hidden_layers"]
    types = _gemma3_layer_types(meta, arch, layers, need("attention.sliding_window_pattern"))
    full_dim = config["head_dim"]
    swa_dim = int(_meta_get(meta, arch, "attention.key_length_swa", full_dim))
    shared = int(_meta_get(meta, arch, "attention.shared_kv_layers", 0))
    first_shared = layers - shared
    kv = config["num_key_value_heads"]
    kv = kv if isinstance(kv, list) else [kv] * layers
    kv_of = {t: {kv[i] for i, ti in enumerate(types) if ti == t} for t in set(types)}
    if any(len(v) > 1 for v in kv_of.values()):
        raise ModelLoadError(f"{path}: gemma4 KV-head counts {kv} differ within a layer type; not supported")
    ffn = config["intermediate_size"]
    ffn = ffn if isinstance(ffn, list) else [ffn] * layers
    double = shared > 0 and ffn[-1] == 2 * ffn[0]
    if ffn != [ffn[0] * (2 if double and i >= first_shared else 1) for i in range(layers)]:
        raise ModelLoadError(f"{path}: gemma4 per-layer feed_forward_length {ffn} is not a Gemma 4 shape "
                             f"(the same in every layer, doubled in the KV-shared ones)")
    rot = int(_meta_get(meta, arch, "rope.dimension_count", full_dim))
    rot_swa = int(_meta_get(meta, arch, "rope.dimension_count_swa", swa_dim))
    if rot != full_dim or rot_swa != swa_dim:
        raise ModelLoadError(f"{path}: gemma4 rope.dimension_count {rot} / _swa {rot_swa} rotate part of a head "
                             f"({full_dim} / {swa_dim}); only rope_freqs' proportional RoPE is supported")
    rope_theta = config["rope_theta"]
    # llama.cpp: the sliding layers' base is the full layers' unless the file says otherwise
    swa_theta = float(_meta_get(meta, arch, "rope.freq_base_swa", rope_theta))
    # K = V full layers have no attn_v (llama.cpp then uses K's projection as V)
    k_eq_v = not any(f"blk.{i}.attn_v.weight" in tensors for i, t in enumerate(types)
                     if t == "full_attention" and i < first_shared)
    moe = bool(_meta_get(meta, arch, "expert_count", 0))
    per_layer = int(_meta_get(meta, arch, "embedding_length_per_layer_input", 0))
    out = dict(
        hidden_activation="gelu_pytorch_tanh",
        intermediate_size=ffn[0],
        use_double_wide_mlp=double,
        head_dim=swa_dim,
        num_key_value_heads=next(iter(kv_of.get("sliding_attention", kv_of["full_attention"]))),
        # transformers >= 5.23's shape for the full layers' own head_dim / KV heads
        per_layer_config={str(i): {"head_dim": full_dim, "num_key_value_heads": kv[i]}
                          for i, t in enumerate(types) if t == "full_attention"},
        layer_types=types,
        sliding_window=int(need("attention.sliding_window")),
        attention_k_eq_v=k_eq_v,
        num_kv_shared_layers=shared,
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=_rows(tensors, "per_layer_token_embd.weight") or config["vocab_size"],
        final_logit_softcapping=_meta_get(meta, arch, "final_logit_softcapping"),
        attention_bias="blk.0.attn_q.bias" in tensors,
        enable_moe_block=moe,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": swa_theta},
            "full_attention": {"rope_type": "proportional", "rope_theta": rope_theta,
                               "partial_rotary_factor": _proportional_factor(tensors, full_dim, path)},
        },
    )
    if moe:
        out.update(num_experts=int(need("expert_count")), top_k_experts=int(need("expert_used_count")),
                   moe_intermediate_size=int(need("expert_feed_forward_length")))
    return out


def _proportional_factor(tensors: dict, head_dim: int, path: Path) -> float:
    """The full layers' partial_rotary_factor from rope_freqs: llama.cpp's
    converter writes 1 for each rotated frequency, then 1e30 (no rotation)."""
    t = tensors.get("rope_freqs.weight")
    if t is None:
        return 1.0
    f = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
    rotated = int((f == 1.0).sum())
    if len(f) != head_dim // 2 or not (f[:rotated] == 1.0).all() or not (f[rotated:] >= 1e29).all():
        raise ModelLoadError(f"{path}: rope_freqs.weight is not Gemma 4's proportional RoPE (1 then 1e30 per "
                             f"frequency of a {head_dim}-dim head); other frequency factors are not supported")
    return rotated / (head_dim // 2)


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


def _gemma3_layer_types(meta: dict, arch: str, layers: int, pattern=None) -> list[str]:
    if pattern is None:
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


def open_reader(path: Path) -> GGUFFile:
    if not path.exists():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"GGUF path {path} is not a file")
    size = path.stat().st_size
    try:
        reader = GGUFFile(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad files
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {t.name} needs bytes {t.data_offset}..{t.data_offset + t.n_bytes}, "
                f"file has {size}"
            )
    return reader


def _unmapped(path: Path, name: str, arch: str) -> ModelLoadError:
    if name == "rope_freqs.weight":
        return ModelLoadError(
            f"{path}: has rope_freqs.weight (llama3-style rope scaling), which this loader does not support")
    if name.startswith(("v.", "mm.", "a.")):
        return ModelLoadError(f"{path}: tensor {name} is a vision / audio tower's; only the language model "
                              f"of a GGUF file is supported")
    return ModelLoadError(f"{path}: tensor {name} has no Hugging Face name for architecture {arch}")


def open_gguf(path: str | Path) -> ModelSource:
    path = Path(path)
    reader = open_reader(path)
    # Vocab arrays are needed whole for the tokenizer; everything else is small.
    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch == "clip":
        raise ModelLoadError(f"{path}: a multimodal projector (mmproj) file; pass the language model's GGUF")
    if arch not in ARCHS:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHS))})"
        )

    tensors = {t.name: t for t in reader.tensors}
    config = build_config(meta, tensors, path)
    layers = config["num_hidden_layers"]
    to_hf = gguf_to_hf_names(arch, config)

    plan: dict[str, list] = {}  # hf name -> its GGUF tensor(s), in file order
    skipped = []                # MTP blocks past the one loaded as `mtp.*` (nextn_predict_layers > 1)
    first_skipped = layers + int(config.get("mtp_num_hidden_layers", 0))
    for name, t in tensors.items():
        hf = to_hf.get(name)
        if hf is None:
            m = re.match(r"blk\.(\d+)\.", name)
            if arch in HYBRID_QWEN and m and int(m[1]) >= first_skipped:
                skipped.append(name)
                continue
            if arch == "gemma4" and name == "rope_freqs.weight":
                continue    # read into the config (partial_rotary_factor)
            raise _unmapped(path, name, arch)
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {name} has quant type {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
            )
        plan.setdefault(hf, []).append(t)
    if skipped:
        log.info("%s: %d tensors of %d MTP blocks (nextn_predict_layers) not loaded: only a single MTP "
                 "block is supported", path.name, len(skipped),
                 int(_meta_get(meta, arch, "nextn_predict_layers", 0)))
    wanted = Counter(to_hf.values())    # GGUF tensors per HF name: 2 for a split one
    present = {hf for hf, ts in plan.items() if len(ts) == wanted[hf]}
    for hf in list(present):    # fused gate and up experts stand for the two, and the two for them
        m = _STACKED_EXPERTS.match(hf)
        if m and m[2] == "gate_up_proj":
            present |= {f"{m[1]}.gate_proj.weight", f"{m[1]}.up_proj.weight"}
        elif m and m[2] == "gate_proj" and f"{m[1]}.up_proj.weight" in present:
            present.add(f"{m[1]}.gate_up_proj.weight")
    missing = [hf for hf in dict.fromkeys(to_hf.values())
               if hf not in present and hf != "lm_head.weight" and not hf.endswith(_OPTIONAL)]
    if missing:
        inverse = {v: k for k, v in to_hf.items() if k not in tensors}
        raise ModelLoadError(
            f"{path}: missing {len(missing)} tensors, first {inverse[missing[0]]} ({missing[0]})"
        )
    # Optional tensors llama.cpp defaults when absent (Gemma 4's layer_scalar: 1).
    absent = [hf for hf in dict.fromkeys(to_hf.values()) if hf.endswith(_OPTIONAL) and hf not in plan]

    try:
        tokenizer = Tokenizer.from_gguf(meta) if "tokenizer.ggml.tokens" in meta else None
    except TokenizerError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    chat_template = meta.get("tokenizer.chat_template") or FALLBACK_TEMPLATES.get(arch)

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permute = arch == "llama"
    norm_offset = arch == "gemma3"
    undo = _qwen_undo(arch, config) if arch in HYBRID_QWEN else None

    from parallel.quant.base import QuantizedTensor
    from parallel.quant.gguf import qtype_name, row_bytes
    # Linear weights in a type the GGUF kernels take: kept as stored with --quantization gguf.
    # Routed experts stay stacked ([E, rows, row bytes]) as parallel.quant.base.GGUFExperts holds them.
    parts = {hf: _stored_parts(hf, ts) for hf, ts in plan.items()} if arch in _BLOCKS_ARCHS else {}
    blocks = {name: qtype_name(int(t.tensor_type)) for ps in parts.values() for name, t, _ in ps
              if name.endswith(_BLOCK_TENSORS) and qtype_name(int(t.tensor_type))}
    # A stack of routed experts stays as blocks only whole (gate, up and down: GGUFExperts).
    for prefix in {m[1] for name in blocks if (m := _STACKED_EXPERTS.match(name))}:
        stack = [f"{prefix}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        if not all(name in blocks for name in stack):
            for name in stack:
                blocks.pop(name, None)

    def permuted(arr: np.ndarray, name: str) -> np.ndarray:
        # Rows are output features, dense or blocks alike.
        if permute and name.endswith("attn_q.weight"):
            return reverse_llama_permute(arr, heads)
        if permute and name.endswith("attn_k.weight"):
            return reverse_llama_permute(arr, kv_heads)
        return arr

    def gguf_blocks(meta: bool = False) -> Iterator[tuple[str, object]]:
        """meta: the blocks as empty meta tensors of their shapes (nothing read:
        what `tqserve plan` measures a rank's resident bytes with)."""
        for hf, ts in plan.items():
            split = len(ts) == 2        # qwen3next's qkvz: always as the file's two (in_proj_qkv, in_proj_z)
            if not split and not any(name in blocks for name, _, _ in parts.get(hf, ())):
                yield from dense(ts, hf)
                continue
            for name, t, half in parts[hf]:
                if name not in blocks:
                    yield from dense([t], name)
                    continue
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                if meta:
                    rows = (shape[0], shape[1] // (2 if half is not None else 1)) if len(shape) == 3 else shape[:1]
                    shape = (*rows, shape[-1])
                    raw = torch.empty(*rows, row_bytes(blocks[name], shape[-1]), dtype=torch.uint8, device="meta")
                    yield name, QuantizedTensor(blocks[name], raw, shape)
                    continue
                if _STACKED_EXPERTS.match(name):    # [E, rows, row bytes]; fused gate + up: this half's rows
                    raw = np.asarray(t.data).reshape(shape[0], shape[1], -1)
                    if half is not None:
                        rows = shape[1] // 2
                        raw, shape = raw[:, half * rows:(half + 1) * rows], (shape[0], rows, shape[2])
                else:
                    raw = permuted(np.asarray(t.data).reshape(shape[0], -1), t.name)
                    if undo is not None:
                        raw = undo(name, raw, rows_only=True)
                raw = np.array(raw, copy=True, order="C")      # off the read-only memmap
                yield name, QuantizedTensor(blocks[name], torch.from_numpy(raw), shape)
        yield from ones()

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for hf, ts in plan.items():
            yield from dense(ts, hf)
        yield from ones()

    def ones() -> Iterator[tuple[str, torch.Tensor]]:
        for hf in absent:
            yield hf, torch.ones(1)

    def dequantized(t) -> np.ndarray:
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            return arr.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        except Exception as e:
            raise ModelLoadError(
                f"{path}: cannot dequantize tensor {t.name} ({t.tensor_type.name}): {type(e).__name__}: {e}"
            ) from e

    def dense(ts: list, hf: str) -> Iterator[tuple[str, torch.Tensor]]:
        if len(ts) == 2:    # qwen3next's in_proj_qkvz from attn_qkv and attn_gate
            part = {t.name.rsplit(".", 2)[1]: dequantized(t) for t in ts}
            arr = merge_qkvz(part["attn_qkv"], part["attn_gate"], config)
        else:
            arr = permuted(dequantized(ts[0]), ts[0].name)
        if norm_offset and hf.endswith("norm.weight"):
            arr = arr - np.float32(1.0)
        if undo is not None:
            arr = undo(hf, arr)
        if arr.dtype != np.float32 or not arr.flags.writeable or not arr.flags.c_contiguous:
            # F32 tensors are views into the read-only memmap: copy those only
            arr = np.array(arr, dtype=np.float32, copy=True, order="C")
        stacked = _STACKED_EXPERTS.match(hf)
        if stacked:     # [E, ...] -> one tensor per expert, as HF checkpoints name them
            parts = [stacked[2]] if stacked[2] != "gate_up_proj" else ["gate_proj", "up_proj"]
            for p, a in zip(parts, np.split(arr, len(parts), axis=1)):     # fused: [gate; up] rows
                for e in range(arr.shape[0]):
                    yield f"{stacked[1]}.{e}.{p}.weight", torch.from_numpy(np.ascontiguousarray(a[e]))
        else:
            yield hf, torch.from_numpy(arr)

    def count(hf: str, ts: list) -> int:
        """How many tensors dense() yields for hf: one per expert (and projection, fused)."""
        stacked = _STACKED_EXPERTS.match(hf)
        if not stacked:
            return 1
        return int(ts[0].shape[-1]) * (2 if stacked[2] == "gate_up_proj" else 1)

    return ModelSource(
        path=path,
        format="gguf",
        config=config,
        tokenizer=tokenizer,
        chat_template=chat_template,
        eos_token_ids=eos_ids(meta, tokenizer),
        generation_config=optional_config("recommended sampling settings", gen_config.from_gguf, meta,
                                          str(path)),
        pooler_config=pool_config.from_gguf(meta, arch),
        _weights_fn=weights,
        # what the streams yield: stacked experts come one expert at a time
        num_tensors=sum(count(hf, ts) for hf, ts in plan.items()) + len(absent),
        stored=blocks,
        # llama.cpp's DeltaNet layouts (split qkvz, tiled value heads) are taken whole only
        stored_splits=arch not in HYBRID_QWEN,
        _stored_fn=gguf_blocks,
        _stored_meta_fn=lambda: gguf_blocks(meta=True),
    )
