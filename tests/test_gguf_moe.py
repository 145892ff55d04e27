"""Qwen3-MoE from a GGUF in llama.cpp's `qwen3moe` layout (router ffn_gate_inp,
experts as one [E, ...] tensor per projection: ffn_gate_exps / ffn_up_exps /
ffn_down_exps), written here from a tiny random transformers model: the config
read back, logits equal transformers' (F32 file), the experts equal to the
file's dequantized values (Q8_0), and through the engine with the attention
projections and the stacked experts kept as GGUF blocks (--quantization gguf)
next to the all-dense load."""
import gguf
import numpy as np
import pytest
import torch
from test_model_parity import CONFIGS, assert_close, make_hf_model

from engine import LLM, SamplingParams
from model_zoo.gguf_loader import open_gguf
from model_zoo.models import create_model
from parallel.quant.base import GGUFBlocks, GGUFExperts

# llama.cpp: every layer routed; Q8_0 blocks of 32 along every row (moe_intermediate_size too)
CONFIG = dict(CONFIGS["qwen3_moe"], mlp_only_layers=[], vocab_size=256, moe_intermediate_size=64)


def write_gguf(path, hf, qtype: str) -> None:
    c = hf.config
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "qwen3moe")
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(512)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    qt = gguf.GGMLQuantizationType[qtype]

    def put(hf_name, value):
        stem, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(stem)}.{suffix}"
        value = value.detach().float().numpy()
        if value.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, value)
        else:
            w.add_tensor(name, gguf.quants.quantize(value, qt), raw_dtype=qt)

    for k, v in hf.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            g, u = v.chunk(2, dim=1)
            put(k.replace("gate_up_proj", "gate_proj.weight"), g)
            put(k.replace("gate_up_proj", "up_proj.weight"), u)
        elif k.endswith("experts.down_proj"):
            put(k + ".weight", v)
        else:
            put(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf():
    return make_hf_model(CONFIG)


def test_f32_file_matches_transformers(hf, tmp_path):
    path = tmp_path / "tiny-qwen3moe-f32.gguf"
    write_gguf(path, hf, "F32")
    src = open_gguf(path)
    c = src.config
    assert (c["model_type"], c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == \
        ("qwen3_moe", 8, 3, 64)
    assert c["norm_topk_prob"] and c["mlp_only_layers"] == []
    assert src.num_tensors == sum(1 for _ in src.weights())      # progress counts what the stream yields
    model = create_model(c, torch.float32, "cpu", src.weights())
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(40), None))
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert_close(ours, ref, "qwen3moe gguf F32")


def test_q8_0_experts_are_the_files_values(hf, tmp_path):
    path = tmp_path / "tiny-qwen3moe-q8.gguf"
    write_gguf(path, hf, "Q8_0")
    src = open_gguf(path)
    assert src.stored["model.layers.0.mlp.experts.down_proj.weight"] == "Q8_0"    # the stacks can stay blocks
    assert "model.layers.0.self_attn.q_proj.weight" in src.stored
    model = create_model(src.config, torch.float32, "cpu", src.weights())         # or be dequantized
    Q8 = gguf.GGMLQuantizationType.Q8_0
    for i in range(CONFIG["num_hidden_layers"]):
        gate_up = hf.state_dict()[f"model.layers.{i}.mlp.experts.gate_up_proj"].numpy()
        want = gguf.quants.dequantize(gguf.quants.quantize(gate_up, Q8), Q8).reshape(gate_up.shape)
        got = model.model.layers[i].mlp.experts.gate_up_proj.numpy()
        # the file stores gate and up as two tensors: each quantized on its own rows, same blocks
        assert np.array_equal(got, want)


def test_engine_gguf_blocks_next_to_dense(hf, tmp_path):
    path = tmp_path / "tiny-qwen3moe-q8.gguf"
    write_gguf(path, hf, "Q8_0")
    args = dict(dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_model_len=256)
    dense = LLM(str(path), quantization="none", **args)
    blocks = LLM(str(path), quantization="gguf", **args)
    held = [m for m in blocks.core.model.modules() if isinstance(getattr(m, "quant", None), GGUFBlocks)]
    assert len(held) >= 2 * CONFIG["num_hidden_layers"]     # qkv and o of every layer, at least
    experts = [m.experts for m in blocks.core.model.modules() if hasattr(m, "experts")]
    assert len(experts) == CONFIG["num_hidden_layers"] and all(isinstance(e.quant, GGUFExperts) for e in experts)
    E, H, Im = CONFIG["num_experts"], CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    for e in experts:      # Q8_0: 34 bytes per 32 weights, and no dense copy
        assert e.quant.nbytes(e) == 3 * E * H * Im * 34 // 32 and e.gate_up_proj.numel() == 0
    prompts = [[int(t) for t in torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (12, 30, 47)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    a, b = dense.generate(prompts, sp), blocks.generate(prompts, sp)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert abs(next(iter(lx.values())) - next(iter(ly.values()))) < 1e-3
