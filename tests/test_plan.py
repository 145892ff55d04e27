"""server/plan.py: the formulas against hand arithmetic and against what the
model and its cache state actually hold."""
import json

import pytest

from server import plan
from test_deepseek_v4 import CONFIG, Case


def test_flash_kv_bytes_per_token_by_hand():
    f16 = plan.make_plan("DeepSeek-V4-Flash", 2, "f16")
    tq3 = plan.make_plan("DeepSeek-V4-Flash", 2, "tq3")
    # 21 CSA layers (m=4): entry 512*2 + indexer key 128*2; 20 HCA layers (m'=128): entry only
    assert f16.kv_per_token == 21 * (1024 + 256) / 4 + 20 * 1024 / 128 == 6880
    tq3_entry = 512 * 3 / 8 + 2     # 3-bit codes + one fp16 norm
    assert tq3.kv_per_token == 21 * (tq3_entry + 256) / 4 + 20 * tq3_entry / 128
    assert tq3.weight_bytes == f16.weight_bytes
    # 1M context on 2 x 128 GB: tq3 fits about 3x as many sequences
    n16 = f16.max_seqs(1 << 20, 128e9, 12e9)
    n3 = tq3.max_seqs(1 << 20, 128e9, 12e9)
    assert 1 <= n16 < n3
    print(f"Flash TP=2, 1M: f16 {n16} seqs, tq3 {n3} seqs; weights/rank {f16.weight_bytes / 1e9:.1f} GB")
    # 284B parameters, experts in FP4: ~160 GB in all, split over 2 ranks
    assert 70e9 < f16.weight_bytes < 90e9


def test_weight_count_equals_the_models_parameters():
    """With every dtype counted as 1 byte and TP=1 the planner's weight bytes are
    the number of values in our model (parameters + tid2eid / router bias)."""
    cfg = dict(CONFIG)
    ones = dict(fp4=1, fp8=1, bf16=1, fp32=1, index=1)
    p = plan.plan_deepseek_v4("tiny", cfg, 1, "f16", 0, dtype_bytes=ones)
    from model_zoo.models import build_model
    model = build_model(cfg)
    n = sum(t.numel() for t in model.parameters()) + sum(t.numel() for t in model.buffers())
    assert p.weight_bytes == n


def test_kv_accounting_matches_the_cache_state():
    """Per-token bytes x L == compressed entries + indexer keys the state holds
    after L tokens; per-sequence bytes == its rings and carry (f16 = fp32 / 2)."""
    c = Case(index_topk=4)
    R = 2
    st, mst = c.ours.new_state(max_rollback=R), c.ours.new_state(max_rollback=R, mtp=True)
    L = 80   # a multiple of both ratios (4 and 16)
    c.step(st, c.ids[:L], 0)
    p = plan.plan_deepseek_v4("tiny", CONFIG, 1, "f16", R)
    held = st.nbytes_by_kind()
    entries = sum(v for kind in held.values() for k, v in kind.items() if k.endswith("_entries"))
    fixed = sum(v for kind in held.values() for k, v in kind.items() if not k.endswith("_entries"))
    fixed += sum(v for kind in mst.nbytes_by_kind().values() for v in kind.values())
    assert p.kv_per_token * L == entries / 2
    assert p.per_sequence == fixed / 2


def test_dense_models():
    q = plan.make_plan("qwen3", 2, "f16")
    assert q.kv_per_token == 64 * (8 // 2) * 2 * 128 * 2          # layers x heads/rank x (K, V) x hd x 2 B
    q3 = plan.make_plan("qwen3", 2, "tq3")
    assert q3.kv_per_token == 64 * 4 * 2 * (128 * 3 / 8 + 2)
    m = plan.make_plan("qwen3-moe", 2, "f16")                       # Qwen3-30B-A3B: 30.5B parameters
    assert m.kv_per_token == 48 * (4 // 2) * 2 * 128 * 2
    assert m.weight_parts["routed experts, 128/t per rank"] == 48 * 128 * 3 * 2048 * 768 * 2 / 2
    ranks, bf16 = 2, 2
    assert 30.4e9 < m.weight_bytes * ranks / bf16 < 30.6e9           # parameters (routers counted twice)
    g = plan.make_plan("gemma3", 2, "f16")
    assert g.kv_per_token == (62 // 6) * 8 * 2 * 128 * 2           # full layers only grow with L
    assert g.seq_bytes(100_000) - g.seq_bytes(50_000) == 50_000 * g.kv_per_token


@pytest.mark.parametrize("model,quant,within", [("deepseek-v4-flash", "auto", 2e-4), ("qwen3", "auto", 1e-5),
                                                 ("gemma3", "auto", 1e-4), ("qwen3-moe", "auto", 1e-5), ("qwen3-next", "auto", 1e-4),
                                                 ("deepseek-v4-flash", None, 0)])
def test_measured_weights_agree_with_the_formulas(model, quant, within):
    """The engine's model built on the meta device (its layers' own storage,
    FP8 / FP4 for DeepSeek-V4 as its checkpoints store them) against the
    formulas, at the real sizes: DeepSeek-V4-Flash 80.5 GB per rank at TP=2,
    ~3.6x that with the experts dequantized to bf16."""
    p = plan.make_plan(model, 2, "f16", dtype="bfloat16", quantization=quant)
    if quant is None:
        assert 3.5 < p.measured_weight_bytes / p.weight_bytes < 3.7
        return
    assert abs(p.measured_weight_bytes / p.weight_bytes - 1) <= within, (p.measured_weight_bytes, p.weight_bytes)
    assert p.resident_weights == p.measured_weight_bytes


def test_config_json_path_and_cli(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(plan.BUILTIN["deepseek-v4-flash"]()))
    assert plan.main(["--model", str(tmp_path), "--kv-cache-dtype", "f16", "tq3",
                      "--max-model-len", "1048576"]) == 0
    out = capsys.readouterr().out
    assert "formulas" in out and "1048576" in out and "tq3" in out
    assert "measured (the engine's model built on the meta device, TP=2, bfloat16, --quantization fp8)" in out
    assert plan.main(["--model", "DeepSeek-V4-Flash", "--json", "--max-model-len", "1048576", "--dtype", "none"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["kv_bytes_per_token_per_rank"] == 6880
    assert data[0]["weight_bytes_per_rank"] == data[0]["weight_bytes_per_rank_formula"]
    import argparse
    sub = argparse.ArgumentParser().add_subparsers()
    plan.add_parser(sub)


def test_measured_kv_equals_the_formulas_and_plans_gemma4():
    """plan_measured (KV bytes from the engine's cache objects for the meta-built
    model's layer specs) agrees with the hand formulas where both exist, and plans
    Gemma 4, whose layers differ in head_dim and KV heads (K = V full layers)."""
    for model, kv in (("qwen3", "tq3"), ("gemma3", "f16"), ("qwen3-next", "tq4"), ("qwen3-moe", "k8v4")):
        name, cfg = plan.load_config(model)
        ref, got = plan.make_plan(model, 2, kv), plan.plan_measured(name, cfg, 2, kv)
        assert (got.kv_per_token, got.per_sequence, got.sliding_tokens) == \
            (ref.kv_per_token, ref.per_sequence, ref.sliding_tokens), model
    g = plan.make_plan("gemma4-31b", 1, "f16")
    assert g.kv_per_token == 10 * 4 * 512 * 2 * 2                    # 10 full layers, 4 KV heads x 512, K and V
    assert g.sliding_tokens == {1024: 50 * 16 * 256 * 2 * 2}          # 50 sliding layers, 16 KV heads x 256
    assert 61e9 < g.measured_weight_bytes < 62e9 and g.weight_bytes == 0   # ~30.7B parameters in bf16
    assert plan.make_plan("gemma4-31b", 1, "tq3").sliding_tokens == g.sliding_tokens   # sliding layers stay f16
    moe = plan.make_plan("gemma4-26b-a4b", 2, "f16")
    assert 25e9 < moe.measured_weight_bytes < 25.5e9                   # ~50.5 GB bf16 over two ranks
    assert moe.kv_per_token == 5 * 1 * 512 * 2 * 2                    # 2 KV heads split over 2 ranks


@pytest.mark.parametrize("model, tp", [("tiny-q4_0", 1), ("tiny-q4_0", 2), ("tiny-q4_k", 1), ("gemma3-270m", 2)])
def test_gguf_file_weights_measured_per_rank(model, tp, tmp_path, capsys):
    """A .gguf file: the plan's weight bytes are what rank 0 of the engine holds
    with the file's blocks kept (--quantization gguf, each rank its part), from
    meta tensors of the blocks' shapes, equal to a real load's."""
    import torch
    from fixtures_models import gguf_path, write_tiny_gguf

    from model_zoo.gguf_loader import open_gguf
    from model_zoo.models import create_model, resident_bytes
    from parallel.state import assume_tp
    if model.startswith("tiny"):
        path = tmp_path / f"{model}.gguf"
        write_tiny_gguf(path, qtype=model.split("-")[1].upper())
    else:
        path = gguf_path(model)
    p = plan.make_plan(str(path), tp, "f16", dtype="float32")
    src = open_gguf(path)
    with assume_tp(tp, 0):
        real = create_model(src.config, torch.float32, "cpu", src.weights(stored=True), stored=src.stored)
    assert p.measured_weight_bytes == resident_bytes(real), (p.measured_weight_bytes, resident_bytes(real))
    assert p.measured_how.endswith("TP=%d, float32, --quantization gguf" % tp)
    if not model.startswith("tiny"):
        return                  # the real file: the count above; the rest on the tiny ones (each open ~4 s)
    dense = plan.make_plan(str(path), tp, "f16", dtype="float32", quantization="none")
    print(f"{model} TP={tp}: {p.measured_weight_bytes / 2**20:.1f} MiB per rank with the blocks, "
          f"{dense.measured_weight_bytes / 2**20:.1f} MiB dequantized")
    assert p.measured_weight_bytes < 0.5 * dense.measured_weight_bytes
    assert plan.main(["--model", str(path), "--tp", str(tp), "--max-model-len", "128", "--dtype", "float32"]) == 0
    assert "--quantization gguf" in capsys.readouterr().out


def test_gemma3_multimodal_checkpoint_counts_its_vision_tower(tmp_path):
    """A Gemma3ForConditionalGeneration config.json: the tower (replicated on
    every rank) is in the formula and in the meta-built engine model alike."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig
    cfg = Gemma3Config(text_config=Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                                    head_dim=32),
                       vision_config=SiglipVisionConfig(image_size=32, patch_size=4, hidden_size=32,
                                                        intermediate_size=64, num_hidden_layers=2,
                                                        num_attention_heads=2, vision_use_head=False),
                       mm_tokens_per_image=16)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    cfg.save_pretrained(tmp_path / "mm")
    cfg.text_config.architectures = ["Gemma3ForCausalLM"]
    cfg.text_config.save_pretrained(tmp_path / "text")
    vision = cfg.vision_config
    per_layer = 4 * (32 * 32 + 32) + (32 * 64 + 64) + (64 * 32 + 32) + 4 * 32
    params = (32 * 3 * 4 * 4 + 32) + 64 * 32 + vision.num_hidden_layers * per_layer + 2 * 32 + (32 * 64 + 32)
    p = plan.make_plan(str(tmp_path / "mm"), 2, "f16", dtype="bfloat16")
    assert p.weight_parts["vision tower (replicated)"] == 2 * params
    text = plan.make_plan(str(tmp_path / "text"), 2, "f16", dtype="bfloat16")
    assert p.weight_bytes - text.weight_bytes == 2 * params
    assert p.measured_weight_bytes - text.measured_weight_bytes == 2 * params
