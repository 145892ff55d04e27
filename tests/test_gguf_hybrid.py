"""Qwen3-Next, Qwen3.5 (dense and MoE) and Gemma 4 (dense and MoE) from GGUF
files in llama.cpp's layouts (`qwen3next`, `qwen35`, `qwen35moe`, `gemma4`),
written here from tiny random transformers models with the value transforms
llama.cpp's converter applies (conversion/qwen.py Qwen3NextModel and
_LinearAttentionVReorderBase, conversion/gemma.py Gemma4Model): the config
read back equals the model's, the logits of an F32 file equal transformers'
fp32 within 1e-4, and a Q8_0 file runs through the engine with the greedy
tokens of its own dequantized weights run without a cache. (Quantized files whose
blocks stay resident: test_gguf_stored_hybrid.py, with these writers.)

The writer here is independent of the loader: its transforms follow the
converter forwards (w + 1 norms, -exp(A_log), squeezed conv kernels, qkvz
split, value heads tiled, renamed scales, rope_freqs)."""
import gguf
import numpy as np
import pytest
import torch
from fixtures_models import write_tiny_gguf
from test_gemma4 import CONFIGS as GEMMA4_CONFIGS
from test_gemma4 import make_hf as make_gemma4
from test_model_parity import assert_close
from test_hybrid_mtp import mtp_state_dict
from test_qwen3_next import FLAVOURS, make_hf

from engine import LLM, SamplingParams
from model_zoo.gguf_file import GGUFFile
from model_zoo.gemma4 import kv_producers, layer_shapes
from model_zoo.gguf_loader import open_gguf
from model_zoo.models import create_model
from model_zoo.source import ModelLoadError

S, F = "sliding_attention", "full_attention"
ARCH = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
Q8 = gguf.GGMLQuantizationType.Q8_0
Q4_0, Q4_K = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_K
TOL = 1e-4

# GGUF arch -> test_qwen3_next flavour. llama.cpp states the layer pattern only as
# full_attention_interval and routes every layer of its MoE archs: 4 layers, every 2nd full.
QWEN = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
EVERY = 2
QWEN_OVERRIDES = dict(num_hidden_layers=4, layer_types=[F if (i + 1) % EVERY == 0 else "linear_attention"
                                                        for i in range(4)])

# Gemma 4 dense: test_gemma4's E2B-like config (per-layer inputs, the last 4 of 8 layers
# KV-shared, double-wide MLP there) with K = V full layers of their own KV-head count (the
# 31B's) and final soft-capping; llama.cpp writes no attention biases.
GEMMA4 = {
    "dense": dict(GEMMA4_CONFIGS["ple"], attention_k_eq_v=True, num_global_key_value_heads=2,
                  attention_bias=False, final_logit_softcapping=30.0),
    # The MoE config without its full-layer rope factor, which a GGUF cannot state (llama.cpp
    # writes rope_freqs of 1 / 1e30 only).
    "moe": dict(GEMMA4_CONFIGS["moe"], rope_parameters=GEMMA4_CONFIGS["dense"]["rope_parameters"]),
}

_hf_cache: dict = {}


def qwen_hf(arch: str, **extra):
    """test_qwen3_next's model for this arch, in the layer layout above (and `extra` config)."""
    key = (arch, *sorted(extra.items()))
    if key not in _hf_cache:
        flavour = QWEN[arch]
        config, cfg_cls, model_cls = FLAVOURS[flavour]
        over = dict(QWEN_OVERRIDES, **({"mlp_only_layers": []} if arch == "qwen3next" else {}), **extra)
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(FLAVOURS, flavour, (dict(config, **over), cfg_cls, model_cls))
            _hf_cache[key] = make_hf(flavour)
    return _hf_cache[key]


def gemma4_hf(key: str, config: dict | None = None):
    """The model of GEMMA4[key], or of `config` (cached under key)."""
    if key not in _hf_cache:
        _hf_cache[key] = make_gemma4(config or GEMMA4[key])
    return _hf_cache[key]


# ---------------------------------------------------------------- the writer

def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """Q4_K blocks of float rows [..., n * 256] -> uint8 [..., n * 144] (gguf-py has no
    Q4_K quantizer): per 32-run j, w = d * sc_j * q - dmin * m_j with 4-bit q and 6-bit
    sc_j, m_j from the run's range (llama.cpp searches for better scales; any valid
    blocks do here: both models read the same ones)."""
    x = a.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0.0), np.maximum(x.max(-1), 0.0)
    scale, low = (hi - lo) / 15, -lo                                    # [B, 8], both >= 0
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (low.max(-1) / 63).astype(np.float16)

    def six_bits(v, unit):
        unit = unit.astype(np.float32)[:, None]
        return np.where(unit > 0, np.round(v / np.where(unit > 0, unit, 1)), 0).clip(0, 63).astype(np.uint8)

    sc, m = six_bits(scale, d), six_bits(low, dmin)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.where(step > 0, np.round((x + offset) / np.where(step > 0, step, 1)), 0).clip(0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)              # runs 2c / 2c + 1 share bytes
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(*a.shape[:-1], a.shape[-1] // 256 * 144)


def finish(w: "gguf.GGUFWriter", tensors: dict[str, np.ndarray], qtype: str, mix: dict | None = None) -> None:
    """Tensors as convert_hf_to_gguf / llama-quantize store them: matrices in qtype
    (Q8_0, Q4_0 or Q4_K; mix: {GGUF name end: type} for the tensors that differ, as
    llama-quantize's mixes do, F16 and F32 too), but routers, conv kernels, norms and
    non-.weight tensors F32. Rows not a whole number of the type's blocks fall back:
    Q4_K to Q4_0 (32-blocks, the same 0.5625 bytes per weight), any to F16."""
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        keep = a.ndim < 2 or not name.endswith(".weight") or \
            name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight"))
        t = next((q for end, q in (mix or {}).items() if name.endswith(end)), qtype)
        if t == "F32" or keep:
            w.add_tensor(name, a)
        elif t == "F16" or a.shape[-1] % 32:
            w.add_tensor(name, a.astype(np.float16))
        elif t == "Q4_K" and a.shape[-1] % 256 == 0:
            w.add_tensor(name, quantize_q4_k(a), raw_dtype=Q4_K)
        else:
            t = Q8 if t == "Q8_0" else Q4_0
            w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tile_v_heads(a: np.ndarray, axis: int, nk: int, head_dim: int) -> np.ndarray:
    """The converter's value-head reorder: grouped by key head -> tiled."""
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    a = a.reshape(nk, -1, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(a, 0, axis)


# The MTP head's own tensors as _Qwen35MtpMixin renames them before mapping (then
# model.layers.N.eh_proj -> blk.N.nextn.eh_proj, ...); its layer mtp.layers.0.* is model.layers.N.*.
MTP_RENAMED = {"mtp.fc": "eh_proj", "mtp.pre_fc_norm_embedding": "enorm", "mtp.pre_fc_norm_hidden": "hnorm",
               "mtp.norm": "shared_head.norm"}
NEXTN = {"eh_proj": "NEXTN_EH_PROJ", "enorm": "NEXTN_ENORM", "hnorm": "NEXTN_HNORM",
         "shared_head.norm": "NEXTN_SHARED_HEAD_NORM"}


def write_qwen(path, hf, arch: str, qtype: str, fused: bool = False, mtp=False, edit=None, mix=None) -> None:
    """mtp: append an MTP block as Qwen3.5's converter does (one more block,
    nextn_predict_layers 1): True: a copy of the last layer plus nextn tensors of
    ones; a dict: that `mtp.*` state dict, converted as _Qwen35MtpMixin does
    (the layer as block N with every transform of a main layer, fc as eh_proj
    unchanged, the (1 + w) norms stored as w + 1)."""
    c = hf.config
    n = c.num_hidden_layers
    names = gguf.get_tensor_name_map(ARCH[arch], n + bool(mtp))
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n + bool(mtp))
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(512)
    w.add_embedding_length(c.hidden_size)
    if getattr(c, "intermediate_size", None):
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(c.head_dim * rope["partial_rotary_factor"]))
    if "mrope_section" in rope:
        w.add_rope_dimension_sections(list(rope["mrope_section"]) + [0] * (4 - len(rope["mrope_section"])))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch != "qwen35":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(dv * nv)
    w.add_full_attention_interval(EVERY)

    out: dict[str, np.ndarray] = {}

    def put(hf_name: str, a: np.ndarray) -> None:
        stem, suffix = hf_name.rsplit(".", 1)
        out[f"{names.get_name(stem)}.{suffix}"] = a

    state = list(hf.state_dict().items())
    if isinstance(mtp, dict):
        for k, v in mtp.items():
            stem, suffix = k.rsplit(".", 1)
            k = f"model.layers.{n}.{MTP_RENAMED[stem]}.{suffix}" if stem in MTP_RENAMED else \
                k.replace("mtp.layers.0.", f"model.layers.{n}.")
            state.append((k, v))
    for k, v in state:
        a = v.detach().float().numpy()
        leaf = k.split(".linear_attn.")[-1]
        if arch != "qwen3next" and nk != nv and ".linear_attn." in k:   # Qwen3.5: value heads tiled
            if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
                a = a.reshape(a.shape[0], -1)
                a = np.concatenate([a[:2 * nk * dk], tile_v_heads(a[2 * nk * dk:], 0, nk, dv)])
            elif leaf == "in_proj_z.weight":
                a = tile_v_heads(a, 0, nk, dv)
            elif leaf in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
                a = tile_v_heads(a, 0, nk, 1)
            elif leaf == "out_proj.weight":
                a = tile_v_heads(a, 1, nk, dv)
        if leaf == "conv1d.weight":
            a = a.reshape(a.shape[0], -1)                   # squeezed [C, 1, K] -> [C, K]
        elif k.endswith("norm.weight") and ".linear_attn." not in k:
            a = a + 1.0                                     # (1 + w) norms stored as w + 1
        if leaf == "A_log":
            out[names.get_name(k)] = -np.exp(a)             # ssm_a, no .weight
        elif leaf == "dt_bias":
            put(k.replace("dt_bias", "dt_proj.bias"), a)
        elif leaf == "in_proj_qkvz.weight":                 # per key head [q, k, v, z] -> [q.., k.., v..], z
            bid = k.split(".")[2]
            q, kk, vv, z = np.split(a.reshape(nk, -1, a.shape[-1]), np.cumsum([dk, dk, a.shape[0] // nk // 2 - dk]),
                                    axis=1)
            out[f"blk.{bid}.attn_qkv.weight"] = np.concatenate([x.reshape(-1, a.shape[-1]) for x in (q, kk, vv)])
            out[f"blk.{bid}.attn_gate.weight"] = z.reshape(-1, a.shape[-1])
        elif k.endswith("experts.gate_up_proj"):
            if fused:                                       # --fuse-gate-up-exps: ffn_gate_up_exps
                put(k + ".weight", a)
            else:
                g, u = np.split(a, 2, axis=1)
                put(k.replace("gate_up_proj", "gate_proj.weight"), g)
                put(k.replace("gate_up_proj", "up_proj.weight"), u)
        elif k.endswith("experts.down_proj"):
            put(k + ".weight", a)
        elif k.startswith(f"model.layers.{n}.") and k.rsplit(".", 1)[0].split(".", 3)[3] in NEXTN:
            stem, suffix = k.rsplit(".", 1)         # not in this gguf package's qwen35 tensor map
            out[gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, NEXTN[stem.split(".", 3)[3]])].format(bid=n)
                + "." + suffix] = a
        else:
            put(k, a)
    if mtp is True:
        last = f"blk.{n - 1}."
        out.update({f"blk.{n}." + k[len(last):]: a for k, a in list(out.items()) if k.startswith(last)})
        for t in ("NEXTN_EH_PROJ", "NEXTN_ENORM", "NEXTN_HNORM", "NEXTN_SHARED_HEAD_NORM"):
            shape = (c.hidden_size, 2 * c.hidden_size) if t == "NEXTN_EH_PROJ" else (c.hidden_size,)
            out[gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, t)].format(bid=n) + ".weight"] = np.ones(shape)
    if edit:
        edit(out)
    finish(w, out, qtype, mix)


def write_gemma4(path, hf, config: dict, qtype: str, edit=None, mix=None) -> None:
    layers, types = config["num_hidden_layers"], config["layer_types"]
    names = gguf.get_tensor_name_map(ARCH["gemma4"], layers)
    rope, full_dim, swa_dim = config["rope_parameters"], config["global_head_dim"], config["head_dim"]
    shared = config.get("num_kv_shared_layers", 0)
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    ffn = config["intermediate_size"]
    w.add_feed_forward_length([ffn * (2 if i >= layers - shared else 1) for i in range(layers)]
                              if config.get("use_double_wide_mlp") else ffn)
    w.add_head_count(config["num_attention_heads"])
    kv, kv_full = config["num_key_value_heads"], config.get("num_global_key_value_heads")
    w.add_head_count_kv([kv if t == S else kv_full for t in types] if kv_full is not None else kv)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    w.add_rope_freq_base(rope[F]["rope_theta"])
    w.add_rope_freq_base_swa(rope[S]["rope_theta"])
    w.add_rope_dimension_count(full_dim)        # proportional: rope_freqs stops the rest
    w.add_rope_dimension_count_swa(swa_dim)
    if config.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    w.add_sliding_window(config["sliding_window"])
    w.add_sliding_window_pattern([t == S for t in types])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    if config.get("enable_moe_block"):
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["top_k_experts"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_vocab_size(config["vocab_size"])

    rotated = int(full_dim * rope[F]["partial_rotary_factor"] / 2)
    out = {"rope_freqs.weight": np.array([1.0] * rotated + [1e30] * (full_dim // 2 - rotated), np.float32)}
    for k, v in hf.state_dict().items():
        a = v.detach().float().numpy()
        if k == "lm_head.weight":
            continue                                        # tied: the file has no output.weight
        if k.endswith("router.scale"):
            out[names.get_name(k.replace("router.scale", "router.proj")) + ".scale"] = a
        elif k.endswith("router.per_expert_scale"):
            out[names.get_name(k.replace("router.per_expert_scale", "experts.down_proj")) + ".scale"] = a
        elif k.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
            out[names.get_name(k) + ".weight"] = a
        else:
            stem, suffix = k.rsplit(".", 1)
            out[f"{names.get_name(stem)}.{suffix}"] = a
    if edit:
        edit(out)
    finish(w, out, qtype, mix)


# ---------------------------------------------------------------- checks

def prompt(vocab: int, n: int = 70) -> torch.Tensor:
    # 70 tokens: past one 64-token delta-rule chunk, and many Gemma sliding windows
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(4))


def logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), None))


def check_against_transformers(src, hf, what: str) -> None:
    assert src.num_tensors == sum(1 for _ in src.weights())      # progress counts what the stream yields
    model = create_model(src.config, torch.float32, "cpu", src.weights())
    ids = prompt(src.config["vocab_size"])
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0].float()
    d = assert_close(logits(model, ids), ref, what)
    assert d < TOL, f"{what}: max |logit diff| {d:.2e} >= {TOL}"


# qwen35 with an MTP block appended (loaded as the model's `mtp.*`, which the main logits do not use).
@pytest.mark.parametrize("arch,fused,mtp", [("qwen3next", False, False), ("qwen35", False, True),
                                            ("qwen35moe", False, False), ("qwen35moe", True, False)])
def test_qwen_f32_file_matches_transformers(arch, fused, mtp, tmp_path):
    hf = qwen_hf(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_qwen(path, hf, arch, "F32", fused, mtp)
    src = open_gguf(path)
    c, h = src.config, hf.config
    keys = ["layer_types", "num_hidden_layers", "head_dim", "num_key_value_heads", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"]
    if arch != "qwen35":
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
    assert {k: c[k] for k in keys} == {k: getattr(h, k) for k in keys}
    assert c["model_type"] == h.model_type and c["partial_rotary_factor"] == 0.25
    assert not src.stored       # an F32 file has no GGUF blocks to keep
    check_against_transformers(src, hf, f"{arch}{' fused experts' if fused else ''} gguf F32")


def mtp_head(hf, seed: int = 1) -> dict:
    """test_hybrid_mtp's random `mtp.*` state dict, norm weights on a 1/256 grid
    (so w + 1 - 1 is w exactly in fp32)."""
    sd = mtp_state_dict(hf, seed)
    return {k: (torch.round(v * 256) / 256 if "norm" in k else v).contiguous() for k, v in sd.items()}


def as_loaded(sd: dict) -> dict:
    """HF state-dict names as the loader yields them: stacked experts one per expert."""
    out = {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            for e, (g, u) in enumerate(zip(*torch.chunk(v, 2, dim=1))):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = g
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = u
        elif k.endswith("experts.down_proj"):
            for e, d in enumerate(v):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = d
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_qwen35_mtp_block_loads_as_the_mtp_head(arch, tmp_path):
    """The MTP block _Qwen35MtpMixin appends (blk.N, nextn_predict_layers 1) comes back
    as the `mtp.*` tensors it was written from, exactly, with mtp_num_hidden_layers 1 and
    the main layers' count; the engine drafts with it, tokens as without speculation."""
    hf = qwen_hf(arch)
    sd = mtp_head(hf)
    path = tmp_path / f"tiny-{arch}-mtp.gguf"
    write_qwen(path, hf, arch, "F32", mtp=sd)
    src = open_gguf(path)
    assert src.config["mtp_num_hidden_layers"] == 1
    assert src.config["num_hidden_layers"] == hf.config.num_hidden_layers == len(src.config["layer_types"])
    got = {k: v for k, v in src.weights() if k.startswith("mtp.")}
    want = as_loaded(sd)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v.float()), k
    if arch != "qwen35":
        return      # the engine run once, on the dense model
    args = dict(dtype="float32", quantization="none", block_size=4, kv_cache_memory=4 << 20, max_model_len=128,
                max_num_seqs=2)
    spec = LLM(str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **args)
    assert spec.core.model.mtp_loaded
    vocab = src.config["vocab_size"]
    prompts = [[int(t) for t in torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (7, 13)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(str(path), **args).generate(prompts, sp)
    out = spec.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert spec.core.get_stats().spec_decode_num_draft_tokens_total > 0


@pytest.mark.parametrize("key", list(GEMMA4))
def test_gemma4_f32_file_matches_transformers(key, tmp_path):
    config = GEMMA4[key]
    hf = gemma4_hf(key)
    path = tmp_path / f"tiny-gemma4-{key}.gguf"
    write_gemma4(path, hf, config, "F32")
    src = open_gguf(path)
    c = src.config
    assert layer_shapes(c) == layer_shapes(config) and kv_producers(c) == kv_producers(config)
    keys = ["layer_types", "attention_k_eq_v", "sliding_window", "hidden_size_per_layer_input",
            "final_logit_softcapping", "num_kv_shared_layers", "use_double_wide_mlp", "enable_moe_block"]
    assert {k: c[k] for k in keys} == {k: getattr(hf.config, k) for k in keys}
    assert c["rope_parameters"] == config["rope_parameters"]     # partial_rotary_factor from rope_freqs
    if config.get("enable_moe_block"):
        assert (c["num_experts"], c["top_k_experts"], c["moe_intermediate_size"]) == (8, 2, 32)
    check_against_transformers(src, hf, f"gemma4 {key} gguf F32")


@pytest.mark.parametrize("arch", ["qwen35moe", "gemma4"])
def test_q8_0_file_through_the_engine(arch, tmp_path):
    """One quantized file per family: every tensor within Q8_0's rounding (half a
    step of max/127 plus the fp16 step size's own rounding: < max/200) of the F32
    file's, and served with the default settings (on the CPU: the blocks kept
    resident, --quantization gguf), the greedy tokens of those weights dequantized
    and run without a cache."""
    files = {q: tmp_path / f"tiny-{arch}-{q}.gguf" for q in ("F32", "Q8_0")}
    for qtype, path in files.items():
        if arch == "gemma4":
            write_gemma4(path, gemma4_hf("dense"), GEMMA4["dense"], qtype)
        else:
            write_qwen(path, qwen_hf(arch), arch, qtype)
    path = files["Q8_0"]
    assert Q8 in {t.tensor_type for t in GGUFFile(path).tensors}
    src = open_gguf(path)
    exact = dict(open_gguf(files["F32"]).weights())
    got = dict(src.weights())
    assert got.keys() == exact.keys()
    for name, want in exact.items():
        assert (got[name] - want).abs().max() < want.abs().max() / 200, name
    ref = create_model(src.config, torch.float32, "cpu", src.weights())
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_model_len=256, max_num_seqs=4)
    vocab = src.config["vocab_size"]
    prompts = [[int(t) for t in torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (12, 30, 47)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ids = list(p)
        for _ in range(6):
            ids.append(int(logits(ref, torch.tensor(ids))[-1].argmax()))
        assert o.outputs[0].token_ids == ids[len(p):]


def test_what_is_not_supported_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "mmproj.gguf", arch="clip")
    with pytest.raises(ModelLoadError, match=r"mmproj.gguf: a multimodal projector \(mmproj\) file"):
        open_gguf(tmp_path / "mmproj.gguf")
    write_tiny_gguf(tmp_path / "vision.gguf", extra_tensors={"v.blk.0.attn_q.weight": (np.zeros(4, np.float32), None)})
    with pytest.raises(ModelLoadError, match=r"tensor v.blk.0.attn_q.weight is a vision / audio tower's"):
        open_gguf(tmp_path / "vision.gguf")
    # qwen3next's in_proj_qkvz needs both of its GGUF tensors
    write_qwen(tmp_path / "half.gguf", qwen_hf("qwen3next"), "qwen3next", "F32",
               edit=lambda t: t.pop("blk.0.attn_gate.weight"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensors, first blk.0.attn_gate.weight"):
        open_gguf(tmp_path / "half.gguf")
    # Gemma 4's experts only fused (no separate ffn_gate_exps / ffn_up_exps in its map)
    write_gemma4(tmp_path / "no-experts.gguf", gemma4_hf("moe"), GEMMA4["moe"], "F32",
                 edit=lambda t: t.pop("blk.1.ffn_gate_up_exps.weight"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensors, first blk.1.ffn_gate_up_exps.weight"):
        open_gguf(tmp_path / "no-experts.gguf")
    # Gemma 4's rope_freqs other than the converter's proportional 1 / 1e30
    write_gemma4(tmp_path / "freqs.gguf", gemma4_hf("moe"), GEMMA4["moe"], "F32",
                 edit=lambda t: t["rope_freqs.weight"].__setitem__(0, 0.5))
    with pytest.raises(ModelLoadError, match=r"rope_freqs.weight is not Gemma 4's proportional RoPE"):
        open_gguf(tmp_path / "freqs.gguf")
