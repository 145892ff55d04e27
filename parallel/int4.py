"""4-bit weights run by torch's CPU int4 kernel, repacked without loss from
checkpoints whose weights already are 4-bit groups (GGUF Q4_1: w = d*q + m
per 32 values, q in 0..15; llama.cpp's quantizer puts the group's min and max
on q = 0 and q = 15, so min/max recover d, m and q exactly).

torch's layout: w = (q - 8) * scale + zero per group of K, scales and zeros
in the activations' dtype, so the kernel is used with bf16 activations (its
fp32 path is a slow reference)."""
from dataclasses import dataclass

import torch

GROUP = 32


@dataclass
class Int4Weight:
    qweight: torch.Tensor        # packed by _convert_weight_to_int4pack_for_cpu
    scales_zeros: torch.Tensor   # [K / group, N, 2]
    group: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return (self.qweight.numel() * self.qweight.element_size()
                + self.scales_zeros.numel() * self.scales_zeros.element_size())


def pack_int4(w: torch.Tensor, dtype: torch.dtype, group: int = GROUP) -> Int4Weight | None:
    """The int4 form of w [N, K] if w holds exact 4-bit asymmetric groups, else None."""
    N, K = w.shape
    if K % group or w.device.type != "cpu":
        return None
    wf = w.detach().float().view(N, K // group, group)
    lo = wf.amin(-1, keepdim=True)
    d = (wf.amax(-1, keepdim=True) - lo) / 15
    d = torch.where(d == 0, torch.ones_like(d), d)
    q = ((wf - lo) / d).round().clamp(0, 15)
    # Exact up to float rounding, or it was not a 4-bit tensor: leave it dense.
    if (q * d + lo - wf).abs().max() > 1e-5 * wf.abs().max().clamp(min=1e-30):
        return None
    qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(N, K).to(torch.int32), 1)
    sz = torch.stack([d.squeeze(-1), (lo + 8 * d).squeeze(-1)], dim=-1)     # [N, K/g, 2]
    return Int4Weight(qweight, sz.transpose(0, 1).contiguous().to(dtype), group, N, K)


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    shape = x.shape
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, w.in_features), w.qweight, w.group,
                                                  w.scales_zeros)
    return y.view(*shape[:-1], w.out_features)
