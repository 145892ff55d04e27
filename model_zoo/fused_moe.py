"""Routed experts shared by the MoE families (DeepSeek-V4, Qwen3-MoE): the
weights of all of this rank's experts in two stacked tensors, run for the
whole batch by parallel.quant.moe.moe_forward (one grouped pass, no Python
loop over tokens).

Expert MLP: g, u = (x @ gate_up[e]^T).chunk(2); h = act(g') * u' with
g' = g.clamp(max=limit), u' = u.clamp(-limit, limit) (DeepSeek-V4's
swiglu_limit; inf for the plain SwiGLU of Qwen3-MoE) and act SiLU, or
gelu_tanh for Gemma 4; y = h @ down[e]^T, weighted by the router and summed
over the token's k experts.

Tensor parallel: each rank holds whole experts, a contiguous range of ids;
ids of other ranks are skipped, and the caller all-reduces the partial sums
(once for the whole MoE block, with any shared expert).

Checkpoints give the experts either fused, as transformers 5 holds them
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), or one
tensor per expert and projection, as Hugging Face checkpoints store them
(`experts.{e}.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H, I]);
load_packed_weights routes the latter here with shard (e, part).
"""
import math

import torch
from torch import nn

from parallel.quant import fp_methods
from parallel.quant.base import DENSE, GGUFExperts
from parallel.quant.moe import moe_forward
from parallel.state import get_tp_rank, get_tp_size

# Per-expert checkpoint projection -> (stacked parameter, part: 0 gate / 1 up / None down).
EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}


class RoutedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, limit: float = math.inf, act: str = "silu"):
        super().__init__()
        tp = get_tp_size()
        if num_experts % tp:
            raise ValueError(f"the number of routed experts ({num_experts}) is not divisible by the "
                             f"tensor-parallel size ({tp})")
        self.num_experts, self.hidden, self.inter, self.limit, self.act = num_experts, hidden, inter, limit, act
        self.num_local = num_experts // tp
        self.first = get_tp_rank() * self.num_local     # global id of this rank's first expert
        self.gate_up_proj = nn.Parameter(torch.zeros(self.num_local, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(self.num_local, hidden, inter), requires_grad=False)
        for p, pieces in ((self.gate_up_proj, 2 * num_experts), (self.down_proj, num_experts)):
            p.weight_loader = self.weight_loader
            p.expert_pieces = pieces      # per-expert checkpoint tensors that fill it
        self.quant = DENSE

    def use_stored(self, fmt: str) -> None:
        """Keep the checkpoint's per-expert tensors in fmt ("mxfp4" | "fp8");
        on the meta-built model: the dense tensors become empty placeholders."""
        self._keep(fp_methods.ExpertWeights(fmt, self.num_local, self.hidden, self.inter))

    def use_gguf(self, qtypes: dict[str, str]) -> None:
        """Keep a GGUF file's stacked expert tensors as blocks ({"gate" | "up" | "down": type})."""
        self._keep(GGUFExperts(qtypes, self.num_local, self.first, self.hidden, self.inter))

    def _keep(self, quant) -> None:
        self.quant = quant
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(self, name)
            p = nn.Parameter(torch.empty(0, dtype=old.dtype, device=old.device), requires_grad=False)
            p.weight_loader = self.weight_loader
            setattr(self, name, p)

    def weight_loader(self, param, loaded, shard_id=None):
        """shard_id None: the fused [E, ...] tensor -> this rank's range.
        (e, part): expert e's gate (part 0) or up (1) rows [I, H] of gate_up_proj,
        or its down_proj [H, I] (part None); another rank's expert is skipped.
        ("all", part): every expert's gate / up / down stacked (a GGUF file's)."""
        if isinstance(shard_id, tuple) and shard_id[0] == "all" and isinstance(self.quant, GGUFExperts):
            self.quant.load({0: "gate", 1: "up", None: "down"}[shard_id[1]], 0, loaded, param.device, param.dtype)
            return
        if self.quant is not DENSE:
            raise ValueError(f"these experts keep their {self.quant.name} weights as stored; the checkpoint gives "
                             f"dense tensors")
        if shard_id is None:
            if loaded.shape[0] != self.num_experts or loaded.shape[1:] != param.shape[1:]:
                raise ValueError(f"shape mismatch: expected {(self.num_experts, *param.shape[1:])}, "
                                 f"got {tuple(loaded.shape)}")
            param.data.copy_(loaded[self.first:self.first + self.num_local])
            return
        e, part = shard_id
        if e == "all":
            raise ValueError("stacked expert tensors: these experts hold dense weights (load the file's "
                             "experts dequantized, or keep them with --quantization gguf)")
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert {e} out of range (the model has {self.num_experts})")
        rows = slice(None) if part is None else slice(part * self.inter, (part + 1) * self.inter)
        dst = param.data[0, rows]
        if loaded.shape != dst.shape:
            raise ValueError(f"shape mismatch: expected {tuple(dst.shape)}, got {tuple(loaded.shape)}")
        local = e - self.first
        if 0 <= local < self.num_local:
            param.data[local, rows].copy_(loaded)

    def forward(self, x, idx, w):   # x [T, H], idx/w [T, k] (global expert ids) -> this rank's partial [T, H]
        local = idx - self.first    # ids of other ranks fall outside [0, num_local): skipped
        if self.quant is not DENSE:
            return self.quant.forward(x, local, w, self.limit, self.act)
        return moe_forward(x, local, w, self.gate_up_proj, self.down_proj, "bf16", self.limit,
                           backend=fp_methods.BACKEND, act=self.act)
