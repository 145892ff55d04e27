"""Tiny random models saved as Hugging Face directories, for engine tests."""
import random

import torch


def save_tiny_llama(path):
    """A 2-layer GQA llama with sharpened weights (greedy decoding never ties),
    saved to path; returns the transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return _save_sharpened(LlamaForCausalLM(cfg), path)


def save_tiny_qwen3(path):
    """A 2-layer GQA Qwen3 (q/k norms, head_dim 32), sharpened as the llama; returns it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return _save_sharpened(Qwen3ForCausalLM(cfg), path)


def save_tiny_qwen3_moe(path):
    """A 3-layer Qwen3-MoE (8 experts, top 2 renormalised; layer 1 dense through
    mlp_only_layers), sharpened as the llama; saved with one tensor per expert,
    as hub checkpoints are; returns it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return _save_sharpened(Qwen3MoeForCausalLM(cfg), path)


def save_tiny_qwen3_next(path):
    """A 6-layer Qwen3-Next (linear, linear, full attention, twice; MoE with a gated
    shared expert, layer 1 dense), sharpened as the llama; returns it."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                          linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4,
                          layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
                          max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return _save_sharpened(Qwen3NextForCausalLM(cfg), path)


def _save_sharpened(m, path):
    m = m.float()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(4.0)
    m.save_pretrained(path, safe_serialization=True)
    return m


def save_tiny_deepseek_v4(path):
    """tests/test_deepseek_v4.py's tiny random DeepSeek-V4 (vocabulary 128;
    run it with block_size 4), saved to path; returns the transformers model."""
    import transformers
    from test_deepseek_v4 import CONFIG, hf_config, randomise
    hf = transformers.DeepseekV4ForCausalLM(hf_config(CONFIG)).eval()
    randomise(list(hf.named_parameters()) + list(hf.named_buffers()), CONFIG["n_routed_experts"],
              CONFIG["num_experts_per_tok"])
    hf.save_pretrained(path)
    return hf


def token_prompts(n, lo=5, hi=60, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def conversation(vocab, seed, users=(9, 16)):
    """A 41-token system prompt and three prompts that add `users` tokens to it."""
    system = [t % vocab for t in token_prompts(1, 41, 42, seed=seed)[0]]
    return system, [system + [t % vocab for t in u] for u in token_prompts(3, *users, seed=seed + 1)]


def save_tiny_qwen3_5(path, moe=False):
    """A 6-layer Qwen3.5 (split DeltaNet projections, mrope for text), dense or
    with a shared-expert MoE in every layer, shaped as save_tiny_qwen3_next."""
    import transformers
    torch.manual_seed(0)
    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    extra = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                 num_experts_per_tok=2) if moe else dict(intermediate_size=96)
    cfg = getattr(transformers, f"{kind}TextConfig")(
        vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1]),
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **extra)
    return _save_sharpened(getattr(transformers, f"{kind}ForCausalLM")(cfg), path)


def save_tiny_gemma4(path, hybrid=False, moe=True):
    """A tiny Gemma 4 text model with K = V full layers (head_dim 512),
    per-layer inputs, KV sharing (the last layer reads layer 1's K/V) and
    routed experts (4, top 2; moe=False: none) beside each MLP, sharpened as the llama;
    returns it (eager attention: modeling_gemma4's reference math).

    Default: 3 full-attention layers, 1 KV head. The engine tests size pools
    as tokens x bytes per token of full attention (test_tq_engine's capacity
    == 100 and 1 MiB pools), which a sliding group's share would break.
    hybrid: 6 layers alternating sliding (head_dim 256, window 16, 1 KV head)
    and full (2 KV heads), the last 2 reading layers 2-3's K/V."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    torch.manual_seed(0)
    shape = (dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3,
                  num_global_key_value_heads=2, num_kv_shared_layers=2) if hybrid else
             dict(num_hidden_layers=3, layer_types=["full_attention"] * 3, num_global_key_value_heads=1,
                  num_kv_shared_layers=1))
    cfg = Gemma4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=256, global_head_dim=512, attention_k_eq_v=True,
                           sliding_window=16, hidden_size_per_layer_input=16, vocab_size_per_layer_input=256,
                           enable_moe_block=moe, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                           max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           tie_word_embeddings=True, **shape)
    # transformers' defaults (sdpa, grouped_mm experts) differ from its own eager code by
    # ~5e-4 in these sharpened logits; the reference is the eager code.
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return _save_sharpened(Gemma4ForCausalLM(cfg), path)


def save_tiny_gemma3(path, sliding_window=8):
    """A 6-layer Gemma 3 (five sliding-window layers to one full, MQA, head_dim
    32), sharpened as the llama; returns it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(1)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=sliding_window,
                           max_position_embeddings=1024, query_pre_attn_scalar=32, bos_token_id=1, eos_token_id=2)
    return _save_sharpened(Gemma3ForCausalLM(cfg), path)


def random_lora(shapes: dict[str, tuple[int, int]], r: int, seed: int, b_scale: float) -> dict:
    """A random LoRA adapter (B not zero): module name -> (A [r, in] / sqrt(in), B [out, r] * b_scale),
    for shapes: module name -> (out, in) of its weight."""
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(r, inp, generator=g) / inp ** 0.5, torch.randn(out, r, generator=g) * b_scale)
            for name, (out, inp) in shapes.items()}



def peft_tensors(parts: dict) -> dict:
    """{module name: (A, B)} under PEFT's tensor names."""
    out = {}
    for name, (a, b) in parts.items():
        out[f"base_model.model.{name}.lora_A.weight"] = a
        out[f"base_model.model.{name}.lora_B.weight"] = b
    return out


def write_peft(path, tensors: dict, **config) -> None:
    """An adapter in PEFT's files: adapter_config.json (config over r 4, lora_alpha 8) and
    adapter_model.safetensors holding tensors (PEFT's names: peft_tensors)."""
    import json

    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
