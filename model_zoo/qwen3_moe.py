"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with a
routed-expert MLP on the sparse layers.

Layer i is sparse when i is not in `mlp_only_layers`, num_experts > 0 and
(i + 1) % decoder_sparse_step == 0; the others keep Qwen3's dense MLP. The
router (`mlp.gate`, [E, H], no bias) takes a softmax in fp32 over all
experts, keeps the top k, renormalises them when norm_topk_prob, and casts
the weights back to the activations' dtype, as transformers does. The
experts (model_zoo.fused_moe) run as one grouped pass for the whole batch.

Tensor parallel: attention as Qwen3; each rank holds E / t whole experts and
the router replicated, and the MoE block all-reduces its partial sums once.
"""
import torch
import torch.nn.functional as F
from torch import nn

from model_zoo.fused_moe import RoutedExperts
from model_zoo.llama import Qwen3ForCausalLM
from parallel.state import all_reduce


def num_experts(config: dict) -> int:
    """Hub config.json files say num_experts; transformers 5 writes num_local_experts."""
    return config.get("num_experts") or config.get("num_local_experts") or 0


class TopKRouter(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts = {num_experts}]")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False)

    def forward(self, x):   # [T, H] -> expert ids [T, k], weights [T, k] in x.dtype
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return idx, w.to(x.dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        E, H = num_experts(config), config["hidden_size"]
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (supported: silu)")
        self.gate = TopKRouter(E, H, config["num_experts_per_tok"], config.get("norm_topk_prob", False))
        self.experts = RoutedExperts(E, H, config["moe_intermediate_size"])

    def forward(self, x):
        idx, w = self.gate(x)
        return all_reduce(self.experts(x, idx, w))


def is_sparse_layer(config: dict, layer_idx: int) -> bool:
    return (layer_idx not in (config.get("mlp_only_layers") or []) and num_experts(config) > 0
            and (layer_idx + 1) % config.get("decoder_sparse_step", 1) == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def _mlp(self, config: dict, layer_idx: int, bias: bool) -> nn.Module:
        return SparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else super()._mlp(config, layer_idx, bias)
