"""`tqserve plan`: weights and KV cache on paper, before anything is loaded.

For a model config (a config.json path, a .gguf file, or a built-in name) at a tensor-parallel
size and a KV cache format, it prints weight bytes per rank, KV bytes per token
per rank (per layer kind), and how many sequences of each context length fit
in the memory left on each rank. Every number comes from the formulas printed
with it (FORMULAS below); the weight bytes are also measured from the
engine's model built on the meta device (measure_weights), and that count,
which is what the engine would hold, sizes the KV budget. Nothing is allocated.

    python -m server.plan --model DeepSeek-V4-Flash --tp 2 --kv-cache-dtype f16 tq3 \
        --max-model-len 32768 131072 1048576

Sharding assumed at TP=t (what parallel/ and the DeepSeek-V4 plan do):
  dense models: q/k/v/o, gate/up/down, embedding and head split t ways; KV
      heads split t ways (replicated when num_key_value_heads < t).
  DeepSeek-V4 (model_zoo/deepseek_v4.py): routed experts split t ways by
      range; shared expert, q_b / sinks / o_a (per head group), o_b, embedding
      and head split t ways; q_a, the shared K=V projection, the compressors,
      indexer, router, norms and hyper-connections replicated. The single K=V
      head, compressed entries and indexer keys are replicated on every rank
      (one KV head cannot be split by heads).
"""
import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9   # torch / kvcache / model_zoo are imported lazily: `tqserve --help` stays fast

FORMULAS = """\
formulas (bytes; t = TP size, L = context length, R = rollback tokens kept for spec decode):
  vector(fmt, d)       f16: 2d   q8: d + 2   tqB: ceil(B*d/8) + 2 * norms (1 fp16 norm per vector, or per g values)
  dense model, per token per rank:
      sum over full-attention layers of  (kv_heads/t) * (vector(K, hd) + vector(V, hd))
      sliding layers: the same per token, but only for min(L, window) tokens (a per-sequence constant)
  DeepSeek-V4, per token per rank (K=V: one vector per entry, replicated on every rank):
      CSA layer: ( vector(kv, D) + 2*Di ) / m          (compressed entry + f16 indexer key every m tokens)
      HCA layer:   vector(kv, D) / m'
      every layer, per sequence: (window - 1 + R) * 2D   (sliding ring, f16)
      CSA/HCA, per sequence: 2 (kv, gate) * cap * width * 2 with cap = (2m + R, m' + R), width = (2D, D) and
                             for CSA's indexer cap = 2m + R, width = 2Di   (compressor carry state)
  weights per rank: sum over tensors of numel * bytes(dtype) / (t if split else 1)
      DeepSeek-V4 dtypes: routed experts FP4 (0.5 + 1/32 for the e8m0 scale per 32); other projections FP8
      (1 + 128x128 block scales); embedding, head, compressor/indexer kv/gate, router BF16; norms, sinks,
      position biases and hyper-connection params FP32
  max sequences at L = floor( (memory - reserve - weights - once) / (L * kv_per_token + per_sequence) )
      once: a linear-attention model's pad slot, one sequence's state (kvcache/linear_state.py)"""


# ---------------------------------------------------------------- built-in configs

def _flash() -> dict:
    return dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=129280, hidden_size=4096,
        num_hidden_layers=43, num_attention_heads=64, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=6, moe_intermediate_size=2048, num_hash_layers=3, hc_mult=4, sliding_window=128,
        index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=1,
        compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0],
        max_position_embeddings=1048576)


def _pro() -> dict:
    # Approximate (from the transformers defaults' docstring and public numbers): pass the
    # real config.json for exact figures.
    n = 61
    return dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=129280, hidden_size=7168,
        num_hidden_layers=n, num_attention_heads=128, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
        q_lora_rank=1536, o_groups=16, o_lora_rank=1024, n_routed_experts=384, n_shared_experts=1,
        num_experts_per_tok=6, moe_intermediate_size=3072, num_hash_layers=3, hc_mult=4, sliding_window=128,
        index_n_heads=64, index_head_dim=128, index_topk=1024, num_nextn_predict_layers=1,
        compress_ratios=[128, 128] + [4 if i % 2 else 128 for i in range(n - 2)] + [0],
        max_position_embeddings=1048576)


BUILTIN = {
    "deepseek-v4-flash": _flash,
    "deepseek-v4-pro": _pro,
    "qwen3-32b": lambda: dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=5120,
        intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960),
    "qwen3-30b-a3b": lambda: dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=40960),
    "qwen3-next-80b-a3b": lambda: dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
        intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=4, partial_rotary_factor=0.25,
        rope_theta=10000000.0, tie_word_embeddings=False, max_position_embeddings=262144),
    # Gemma 4 (approximate, from public model cards: pass the real config.json for exact figures):
    # 5 sliding (head_dim 256) : 1 full (512, K = V) layers, window 1024, tied embeddings.
    "gemma4-31b": lambda: dict(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=262144, hidden_size=5376,
        intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16,
        head_dim=256, global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
        sliding_window=1024, hidden_size_per_layer_input=0, num_kv_shared_layers=0, tie_word_embeddings=True,
        final_logit_softcapping=30.0, max_position_embeddings=262144),
    "gemma4-26b-a4b": lambda: dict(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=262144, hidden_size=2816,
        intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True,
        sliding_window=1024, hidden_size_per_layer_input=0, num_kv_shared_layers=0, enable_moe_block=True,
        num_experts=128, top_k_experts=8, moe_intermediate_size=704, tie_word_embeddings=True,
        final_logit_softcapping=30.0, max_position_embeddings=262144),
    "gemma3-27b": lambda: dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208, hidden_size=5376,
        intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, sliding_window=1024, sliding_window_pattern=6, tie_word_embeddings=True,
        max_position_embeddings=131072),
}
ALIASES = {"deepseek-v4": "deepseek-v4-flash", "flash": "deepseek-v4-flash", "pro": "deepseek-v4-pro",
           "qwen3": "qwen3-32b", "qwen3-moe": "qwen3-30b-a3b", "qwen3-next": "qwen3-next-80b-a3b", "gemma3": "gemma3-27b"}


def load_config(model: str) -> tuple[str, dict]:
    key = model.strip().lower()
    key = ALIASES.get(key, key)
    if key in BUILTIN:
        return key, BUILTIN[key]()
    p = Path(model)
    if p.suffix == ".gguf" and p.is_file():
        return str(p), open_gguf_source(p).config
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise SystemExit(f"--model {model!r}: not a built-in name ({', '.join(BUILTIN)}) nor a config.json")
    cfg = json.loads(p.read_text())
    if "num_hidden_layers" in cfg:
        return str(p), cfg
    if "vision_config" in cfg:      # a multimodal checkpoint the engine runs with its tower
        from model_zoo.hf_loader import fill_derived_config
        return str(p), fill_derived_config(cfg)
    return str(p), cfg.get("text_config", cfg)


# ---------------------------------------------------------------- accounting

def parse_preset(name: str):
    from kvcache.kv_formats import parse_preset as parse
    return parse(name)


def vector_bytes(fmt, d: int) -> float:
    """Bytes of one d-vector in a kvcache.turboquant.ComponentFormat."""
    if fmt.kind == "f16":
        return 2 * d
    if fmt.kind == "int8":
        return d + 2
    norms = d // fmt.group if fmt.group else 1
    return math.ceil(fmt.bits * d / 8) + 2 * norms


@dataclass
class Plan:
    name: str
    tp: int
    kv_cache_dtype: str
    weight_bytes: float = 0.0                       # per rank
    weight_parts: dict = field(default_factory=dict)
    kv_per_token: float = 0.0                        # per rank, grows with L
    kv_per_token_by_kind: dict = field(default_factory=dict)
    per_sequence: float = 0.0                        # per rank, independent of L (bounded windows, carry)
    per_sequence_by_kind: dict = field(default_factory=dict)
    once: float = 0.0                                # per rank, once: the linear-attention state's pad slot
    sliding_tokens: dict = field(default_factory=dict)   # dense sliding layers: bytes per token, up to window
    notes: list = field(default_factory=list)
    measured_weight_bytes: float | None = None       # per rank, from the engine's model built on the meta device
    measured_how: str = ""

    @property
    def resident_weights(self) -> float:
        """What the engine holds per rank: measured when the build ran, else the formula."""
        return self.weight_bytes if self.measured_weight_bytes is None else self.measured_weight_bytes

    def seq_bytes(self, L: int) -> float:
        extra = sum(b * min(L, w) for w, b in self.sliding_tokens.items())
        return L * self.kv_per_token + self.per_sequence + extra

    def max_seqs(self, L: int, memory: float, reserve: float) -> int:
        free = memory - reserve - self.resident_weights - self.once
        return max(0, int(free // self.seq_bytes(L))) if free > 0 else 0


# kvcache/pool_plan.py's SNAPSHOT_SHARE / SNAPSHOTS_PER_SEQ (not imported: `tqserve --help` stays fast).
SNAPSHOT_NOTE = ("prefix caching keeps snapshots of the per-sequence state (4 per running sequence, at most 25% "
                 "of the KV memory), which the table below leaves out: with it on (the default) count up to a "
                 "quarter fewer sequences, or serve with --no-enable-prefix-caching")


def _add(d: dict, k: str, v: float) -> None:
    d[k] = d.get(k, 0.0) + v


# Bytes per stored weight value in the official DeepSeek-V4 checkpoints.
V4_DTYPE_BYTES = dict(fp4=0.5 + 1 / 32, fp8=1 + 4 / (128 * 128), bf16=2.0, fp32=4.0, index=4.0)


def plan_deepseek_v4(name: str, cfg: dict, tp: int, kv: str, rollback: int,
                     dtype_bytes: dict | None = None) -> Plan:
    from model_zoo.deepseek_v4 import CSA, HCA, SWA, normalise_config
    c = normalise_config(cfg)
    p = Plan(name, tp, kv)
    H, D, nh, V = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["vocab_size"]
    qr, og, olr = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    E, I = c["n_routed_experts"], c["moe_intermediate_size"]
    Di, nhi, hc, W = c["index_head_dim"], c["index_n_heads"], c["hc_mult"], c["sliding_window"]
    db = dtype_bytes or V4_DTYPE_BYTES
    FP4, FP8, BF16, FP32, IDX = db["fp4"], db["fp8"], db["bf16"], db["fp32"], db["index"]
    m, mh = c["compress_rates"][CSA], c["compress_rates"][HCA]
    w = p.weight_parts

    def layer(kind: str, hash_layer: bool, part: str):
        _add(w, part + " attention (split)", (qr * nh * D + nh * D * olr + og * olr * H) * FP8 / tp + nh * FP32 / tp)
        _add(w, part + " attention (replicated)", (H * qr + H * D) * FP8 + (qr + D) * FP32)
        if kind == CSA:
            _add(w, part + " compressor+indexer", 2 * H * 2 * D * BF16 + m * 2 * D * FP32 + D * FP32
                 + 2 * H * 2 * Di * BF16 + m * 2 * Di * FP32 + Di * FP32 + qr * nhi * Di * FP8 + H * nhi * BF16)
        elif kind == HCA:
            _add(w, part + " compressor+indexer", 2 * H * D * BF16 + mh * D * FP32 + D * FP32)
        _add(w, part + " routed experts (split)", E * 3 * H * I * FP4 / tp)
        _add(w, part + " shared expert (split)", 3 * H * I * c["n_shared_experts"] * FP8 / tp)
        _add(w, part + " router", E * H * BF16
             + (V * c["num_experts_per_tok"] * IDX if hash_layer else E * FP32))
        hc_params = (2 + hc) * hc * hc * H + (2 + hc) * hc + 3
        _add(w, part + " norms, hyper-connections", 2 * H * FP32 + 2 * hc_params * FP32)

    for i, kind in enumerate(c["layer_types"]):
        layer(kind, c["mlp_layer_types"][i] == "hash_moe", "layers:")
    if c.get("num_nextn_predict_layers", 0):
        layer(SWA, False, "mtp:")
        _add(w, "mtp: e/h proj, norms, hc head", 2 * H * H * FP8 + 3 * H * FP32 + (hc * hc * H + hc + 1) * FP32)
    _add(w, "embedding + head (split)", 2 * V * H * BF16 / tp)
    _add(w, "final norm, hc head", H * FP32 + (hc * hc * H + hc + 1) * FP32)
    p.weight_bytes = sum(w.values())

    kfmt, _ = parse_preset(kv)
    entry = vector_bytes(kfmt, D)
    ring = (W - 1 + rollback) * 2 * D
    n_layers = len(c["layer_types"]) + (1 if c.get("num_nextn_predict_layers", 0) else 0)
    _add(p.per_sequence_by_kind, "sliding rings (all layers + mtp)", n_layers * ring)
    for kind in c["layer_types"]:
        if kind == CSA:
            _add(p.kv_per_token_by_kind, f"CSA compressed KV ({kfmt.name})", entry / m)
            _add(p.kv_per_token_by_kind, "CSA indexer keys (f16)", 2 * Di / m)
            _add(p.per_sequence_by_kind, "compressor carry",
                 2 * (2 * m + rollback) * 2 * D * 2 + 2 * (2 * m + rollback) * 2 * Di * 2)
        elif kind == HCA:
            _add(p.kv_per_token_by_kind, f"HCA compressed KV ({kfmt.name})", entry / mh)
            _add(p.per_sequence_by_kind, "compressor carry", 2 * (mh + rollback) * D * 2)
    p.kv_per_token = sum(p.kv_per_token_by_kind.values())
    p.per_sequence = sum(p.per_sequence_by_kind.values())
    counts = {k: c["layer_types"].count(k) for k in (SWA, CSA, HCA)}
    p.notes.append(f"layers: {counts[SWA]} sliding, {counts[CSA]} CSA (m={m}), {counts[HCA]} HCA (m'={mh})"
                   f"{', + 1 MTP (sliding)' if c.get('num_nextn_predict_layers', 0) else ''}; "
                   f"window {W}, D={D}, indexer d={Di}")
    p.notes.append(SNAPSHOT_NOTE)
    return p


def plan_dense(name: str, cfg: dict, tp: int, kv: str) -> Plan:
    p = Plan(name, tp, kv)
    H, L, nh = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    I, V = cfg["intermediate_size"], cfg["vocab_size"]
    BF16 = 2.0
    attn = H * nh * hd * 2 + H * nkv * hd * 2
    sparse = moe_layers(cfg)
    p.weight_parts["layers (split)"] = (L * attn + (L - len(sparse)) * 3 * H * I) * BF16 / tp
    _moe_parts(p, cfg, sparse, tp)
    p.weight_parts["norms (replicated)"] = L * (2 * H + (4 if "gemma" in cfg.get("model_type", "") else 0) * H) * BF16
    tied = cfg.get("tie_word_embeddings", False)
    p.weight_parts["embedding + head (split)"] = (1 if tied else 2) * V * H * BF16 / tp
    p.weight_bytes = sum(p.weight_parts.values())
    kfmt, vfmt = parse_preset(kv)
    kv_heads = max(1, nkv // tp) if nkv >= tp else nkv
    if nkv < tp:
        p.notes.append(f"{nkv} KV heads < tp {tp}: KV heads replicated")
    types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if not types:
        pattern = cfg.get("sliding_window_pattern")
        if "gemma3" in cfg.get("model_type", "") and pattern:
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(L)]
        else:
            types = ["full_attention"] * L
    full = types.count("full_attention")
    sliding = L - full
    # Per the KV policy, sliding layers stay f16 by default.
    tok = kv_heads * (vector_bytes(kfmt, hd) + vector_bytes(vfmt, hd))
    p.kv_per_token_by_kind[f"full attention ({kfmt.name}/{vfmt.name})"] = full * tok
    p.kv_per_token = full * tok
    if sliding:
        p.sliding_tokens[window] = sliding * kv_heads * 4 * hd
        p.per_sequence_by_kind[f"sliding layers, up to {window} tokens (f16)"] = p.sliding_tokens[window] * window
    p.notes.append(f"layers: {full} full, {sliding} sliding; {nkv} KV heads x {hd}")
    return p


def _moe_parts(p: Plan, cfg: dict, sparse: list[int], tp: int) -> None:
    if not sparse:
        return
    from model_zoo.qwen3_moe import num_experts
    H, E, Im, BF16 = cfg["hidden_size"], num_experts(cfg), cfg["moe_intermediate_size"], 2.0
    p.weight_parts[f"routed experts, {E}/t per rank"] = len(sparse) * E * 3 * H * Im * BF16 / tp
    p.weight_parts["routers (replicated)"] = len(sparse) * E * H * BF16
    if cfg.get("shared_expert_intermediate_size"):
        Is = cfg["shared_expert_intermediate_size"]
        p.weight_parts["shared experts (split)"] = len(sparse) * 3 * H * Is * BF16 / tp
        p.weight_parts["shared-expert gates (replicated)"] = len(sparse) * H * BF16
    p.notes.append(f"MoE: {len(sparse)} sparse layers, {E} experts x {Im}, top {cfg['num_experts_per_tok']}")


def plan_hybrid(name: str, cfg: dict, tp: int, kv: str) -> Plan:
    """Qwen3-Next / Qwen3.5: gated full-attention layers (paged KV) and Gated DeltaNet
    layers (a fixed state per sequence, split by key head), model_zoo/qwen3_next.py."""
    from model_zoo.qwen3_next import layer_types
    p = Plan(name, tp, kv)
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    types = layer_types(cfg)
    full, linear, BF16 = types.count("full_attention"), types.count("linear_attention"), 2.0
    conv_dim = 2 * nk * dk + nv * dv
    sparse = moe_layers(cfg)
    p.weight_parts["full attention (split)"] = full * H * (3 * nh * hd + 2 * nkv * hd) * BF16 / tp
    p.weight_parts["linear attention (split)"] = linear * (H * (2 * nk * dk + 3 * nv * dv + 2 * nv)
                                                           + conv_dim * K + 2 * nv) * BF16 / tp
    p.weight_parts["dense MLPs (split)"] = (len(types) - len(sparse)) * 3 * H * cfg.get("intermediate_size", 0) \
        * BF16 / tp
    _moe_parts(p, cfg, sparse, tp)
    p.weight_parts["norms (replicated)"] = (len(types) * 2 * H + full * 2 * hd + linear * dv) * BF16
    p.weight_parts["embedding + head (split)"] = (1 if cfg.get("tie_word_embeddings") else 2) * \
        cfg["vocab_size"] * H * BF16 / tp
    p.weight_bytes = sum(p.weight_parts.values())
    kfmt, vfmt = parse_preset(kv)
    kv_heads = max(1, nkv // tp) if nkv >= tp else nkv
    tok = kv_heads * (vector_bytes(kfmt, hd) + vector_bytes(vfmt, hd))
    p.kv_per_token_by_kind[f"full attention ({kfmt.name}/{vfmt.name})"] = full * tok
    p.kv_per_token = full * tok
    # conv inputs (K - 1 per channel) + recurrent state [nv, dk, dv], fp32, this rank's heads
    state = linear * 4 * (conv_dim // tp * (K - 1) + nv // tp * dk * dv)
    p.per_sequence_by_kind["linear-attention state (fp32)"] = state
    p.per_sequence = p.once = state
    p.notes.append(f"layers: {full} full attention, {linear} linear attention (Gated DeltaNet); "
                   f"{nkv} KV heads x {hd}")
    p.notes.append(SNAPSHOT_NOTE)
    return p


def plan_measured(name: str, cfg: dict, tp: int, kv: str, block_size: int = 16) -> Plan:
    """A family without a hand formula (Gemma 4: head_dim and KV heads per layer type,
    K = V layers, KV-shared layers): the KV bytes of each layer the engine's
    meta-built model asks a cache for, measured on the engine's own cache object
    for it (one block, on the meta device), under the KV format's per-layer policy."""
    import torch

    from kvcache.pool_plan import kv_dtype, make_layer_cache
    from model_zoo.models import build_model
    from parallel.state import assume_tp
    with assume_tp(tp, 0), torch.device("meta"):
        specs = build_model(cfg).kv_cache_spec()
    policy, n = kv_dtype(kv, torch.bfloat16), max(s.layer_idx for s in specs) + 1
    p = Plan(name, tp, kv)
    for s in specs:
        b = make_layer_cache(s, 1, block_size, policy, 0, n, device="meta").nbytes
        if s.per_seq:
            p.per_sequence += b
            p.once += b
            _add(p.per_sequence_by_kind, "linear-attention state", b)
        elif s.sliding_window is None:
            p.kv_per_token += b / block_size
            _add(p.kv_per_token_by_kind, f"full attention, {s.num_kv_heads} KV heads x {s.head_dim}", b / block_size)
        else:
            w = s.sliding_window
            p.sliding_tokens[w] = p.sliding_tokens.get(w, 0.0) + b / block_size
    for w, b in p.sliding_tokens.items():
        p.per_sequence_by_kind[f"sliding layers, up to {w} tokens"] = b * w
    kinds = [("per-seq" if s.per_seq else "full" if s.sliding_window is None else "sliding") for s in specs]
    p.notes.append(f"{n} layers, {len(specs)} with a cache of their own: {kinds.count('full')} full, "
                   f"{kinds.count('sliding')} sliding; KV bytes measured on the engine's cache objects "
                   f"(no hand formula for this family)")
    return p


def moe_layers(cfg: dict) -> list[int]:
    """Indices of the routed-expert layers of a Qwen3-MoE-style config (none for dense models)."""
    if "moe_intermediate_size" not in cfg:
        return []
    from model_zoo.qwen3_moe import is_sparse_layer
    return [i for i in range(cfg["num_hidden_layers"]) if is_sparse_layer(cfg, i)]


def is_deepseek_v4(cfg: dict) -> bool:
    return cfg.get("model_type") == "deepseek_v4" or (cfg.get("architectures") or [""])[0] == "DeepseekV4ForCausalLM"


def open_gguf_source(path, mmproj=None):
    """The file's ModelSource (header and tensor infos; no tensor read), with
    its vision tower's mmproj file (model_zoo/mmproj.py) when given."""
    from model_zoo.gguf_loader import open_gguf
    from model_zoo.mmproj import attach_mmproj
    from model_zoo.source import ModelLoadError
    try:
        source = open_gguf(path)
        if mmproj is not None:
            attach_mmproj(source, mmproj)
        return source
    except ModelLoadError as e:
        raise SystemExit(f"--model {path}: {e}") from None


def measure_weights(cfg: dict, tp: int, dtype: str = "bfloat16", quantization: str | None = None,
                    fmts: dict[str, str] | None = None, rank: int = 0, gguf=None) -> int:
    """Bytes of weights one rank of the engine holds for cfg, measured from
    the tensors of its model built on the meta device (no memory) under
    TP=tp (rank `rank`), as model_zoo.models.resident_bytes counts them at startup.
    quantization "fp8" (DeepSeek-V4): the layers keep the official
    checkpoint's FP8 / FP4 tensors (fmts, {tensor: format}; default
    dsv4_checkpoint.official_formats), loaded as empty meta tensors so each
    layer allocates its own storage. quantization "gguf" (gguf: the file's
    ModelSource): the layers keep this rank's part of the file's blocks, from
    meta tensors of their shapes (the dense tensors, norms mostly, are read)."""
    import torch

    from model_zoo.models import build_model, create_model, resident_bytes
    from parallel.state import assume_tp
    if quantization == "gguf":
        if gguf is None:
            raise SystemExit("--quantization gguf: pass a .gguf file as --model")
        with assume_tp(tp, rank):
            model = create_model(cfg, getattr(torch, dtype), "meta", gguf.weights(stored=True, meta=True),
                                 stored=gguf.stored)
        return resident_bytes(model)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with assume_tp(tp, rank), torch.device("meta"):
            model = build_model(cfg)
            if quantization == "fp8":
                if not is_deepseek_v4(cfg):
                    raise SystemExit("--quantization fp8: only DeepSeek-V4 configs have FP8 / FP4 checkpoints")
                from model_zoo.dsv4_checkpoint import load_into, meta_checkpoint, official_formats
                fmts = fmts or official_formats(model)
                model.use_stored(fmts)
                load_into(model, meta_checkpoint(model, fmts), partial=True)
            elif quantization:
                raise SystemExit(f"--quantization {quantization}: the planner measures none, fp8 "
                                 f"(DeepSeek-V4) or gguf (a .gguf file)")
    finally:
        torch.set_default_dtype(prev)
    return resident_bytes(model)


def tower_bytes(cfg: dict, dtype: str) -> int:
    """A multimodal model's vision tower (its `vision` module), whole on every rank."""
    import torch

    from model_zoo.models import build_model
    from model_zoo.multimodal import image_processor_for
    if image_processor_for(cfg) is None:
        return 0
    with torch.device("meta"):
        model = build_model(cfg)
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return sum(t.numel() for t in model.vision.parameters()) * size


def make_plan(model: str, tp: int = 2, kv_cache_dtype: str = "f16", rollback: int = 3,
              dtype: str | None = None, quantization: str | None = "auto", mmproj: str | None = None) -> Plan:
    """The formulas' plan; with dtype, also the weights measured from a meta
    build (quantization "auto": fp8 for DeepSeek-V4, what it is served with).
    mmproj: a .gguf model's vision tower file."""
    gguf = open_gguf_source(model, mmproj) if model.endswith(".gguf") and Path(model).is_file() else None
    if mmproj is not None and gguf is None:
        raise SystemExit("--mmproj goes with a .gguf --model")
    name, cfg = (model, gguf.config) if gguf is not None else load_config(model)
    v4 = is_deepseek_v4(cfg)
    if v4:
        p = plan_deepseek_v4(name, cfg, tp, kv_cache_dtype, rollback)
    elif "linear_num_key_heads" in cfg:      # Qwen3-Next / Qwen3.5: linear-attention layers
        p = plan_hybrid(name, cfg, tp, kv_cache_dtype)
    elif cfg.get("model_type", "").startswith("gemma4"):
        p = plan_measured(name, cfg, tp, kv_cache_dtype)
        dtype = dtype or "bfloat16"          # no weight formula either: always measured
    else:
        p = plan_dense(name, cfg, tp, kv_cache_dtype)
    vision = tower_bytes(cfg, dtype or "bfloat16")
    if vision:
        p.weight_parts["vision tower (replicated)"] = vision
        p.weight_bytes += vision
    if dtype:
        auto = "fp8" if v4 else "gguf" if gguf is not None and gguf.stored else None
        quant = auto if quantization == "auto" else None if quantization in (None, "none") else quantization
        p.measured_weight_bytes = measure_weights(cfg, tp, dtype, quant, gguf=gguf)
        p.measured_how = f"the engine's model built on the meta device, TP={tp}, {dtype}" + \
            (f", --quantization {quant}" if quant else "")
    return p


# ---------------------------------------------------------------- CLI

DEFAULT_LENS = [4096, 32768, 131072, 1048576]


def _fmt(b: float) -> str:
    return f"{b / GB:,.2f} GB" if b >= 1e8 else f"{b / 1e6:,.3f} MB" if b >= 1e4 else f"{b:,.1f} B"


def report(plans: list[Plan], lens: list[int], memory: float, reserve: float, out=None) -> None:
    out = out or sys.stdout
    p0 = plans[0]
    print(f"model {p0.name}, TP={p0.tp}, memory {memory / GB:.0f} GB per rank "
          f"({p0.tp} x {memory / GB:.0f} GB), reserve {reserve / GB:.0f} GB per rank", file=out)
    for n in p0.notes:
        print("  " + n, file=out)
    if p0.measured_weight_bytes is not None:
        formula = f"; the formula: {_fmt(p0.weight_bytes)}" if p0.weight_parts else ""
        print(f"weights per rank: {_fmt(p0.measured_weight_bytes)} measured ({p0.measured_how}){formula}", file=out)
    else:
        print(f"weights per rank: {_fmt(p0.weight_bytes)} (formula)", file=out)
    for k, v in p0.weight_parts.items():
        print(f"  {k:<40} {_fmt(v)}", file=out)
    for p in plans:
        print(f"kv cache {p.kv_cache_dtype}: {p.kv_per_token:,.1f} bytes per token per rank", file=out)
        for k, v in p.kv_per_token_by_kind.items():
            print(f"  {k:<40} {v:,.1f} B/token", file=out)
        for k, v in p.per_sequence_by_kind.items():
            print(f"  {k:<40} {_fmt(v)} per sequence", file=out)
        if p.once:
            print(f"  {'pad slot (CUDA graph pad rows)':<40} {_fmt(p.once)} once", file=out)
    print("max concurrent sequences per rank pair:", file=out)
    print("  " + f"{'context':>10}" + "".join(f"  {p.kv_cache_dtype + ' GB/seq':>14}  {p.kv_cache_dtype + ' seqs':>10}"
                                               for p in plans), file=out)
    for L in lens:
        row = f"  {L:>10}"
        for p in plans:
            row += f"  {p.seq_bytes(L) / GB:>14.3f}  {p.max_seqs(L, memory, reserve):>10}"
        print(row, file=out)
    print(FORMULAS, file=out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"config.json (or its folder), a .gguf file, or a built-in: {', '.join(BUILTIN)}")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (one rank per node)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["f16", "tq3"],
                   help="one or more KV formats to compare (f16, tq4, tq3, k8v4, ...)")
    p.add_argument("--max-model-len", type=int, nargs="+", default=DEFAULT_LENS, help="context lengths")
    p.add_argument("--memory-gb", type=float, default=128.0, help="memory per rank (node), GB")
    p.add_argument("--reserve-gb", type=float, default=12.0,
                   help="per rank, kept for the OS, runtime and activations")
    p.add_argument("--rollback", type=int, default=3, help="speculative tokens the DeepSeek-V4 state can roll back")
    p.add_argument("--dtype", default="bfloat16",
                   help="dtype of the weights that stay dense, for the measured count ('none': formula only)")
    p.add_argument("--quantization", default="auto",
                   help="fp8 (DeepSeek-V4's FP8 / FP4 kept as stored), gguf (a .gguf file's blocks, each rank "
                        "its part) or none; auto: fp8 for DeepSeek-V4, gguf for a .gguf file")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="a .gguf model's vision tower (llama.cpp's clip GGUF), counted with it")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run(args: argparse.Namespace) -> int:
    dtype = None if args.dtype.lower() == "none" else args.dtype
    quant = None if args.quantization.lower() == "none" else args.quantization
    plans = [make_plan(args.model, args.tp, kv, args.rollback, dtype if i == 0 else None, quant, args.mmproj)
             for i, kv in enumerate(args.kv_cache_dtype)]
    for p in plans[1:]:
        p.measured_weight_bytes, p.measured_how = plans[0].measured_weight_bytes, plans[0].measured_how
    memory, reserve = args.memory_gb * GB, args.reserve_gb * GB
    if args.json:
        json.dump([dict(model=p.name, tp=p.tp, kv_cache_dtype=p.kv_cache_dtype, weight_bytes_per_rank=p.resident_weights,
                        weight_bytes_per_rank_formula=p.weight_bytes,
                        kv_bytes_per_token_per_rank=p.kv_per_token, kv_bytes_per_token_by_kind=p.kv_per_token_by_kind,
                        per_sequence_bytes=p.per_sequence,
                        max_seqs={L: p.max_seqs(L, memory, reserve) for L in args.max_model_len})
                   for p in plans], sys.stdout, indent=1)
        print()
    else:
        report(plans, args.max_model_len, memory, reserve)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `plan` on an argparse subparsers object; the subcommand's
    handler is in `func` (call args.func(args))."""
    p = subparsers.add_parser("plan", help="weights / KV cache / concurrency on paper for a config")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tqserve plan", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
