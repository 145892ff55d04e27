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


def token_prompts(n, lo=5, hi=60, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
