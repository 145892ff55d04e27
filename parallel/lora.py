"""LoRA adapters on the parallel linear layers, several per batch (vLLM's
multi-LoRA serving).

Each linear layer that adapters may target holds `max_loras` slots of (A, B)
(`LoRASlots`): A [slots, rank, input columns of this rank], B [slots, output
rows of this rank, rank], the adapter's scaling folded into B. A fused layer
(q/k/v, gate/up) keeps its sub-projections' adapters side by side in the
rank dimension: sub-projection i owns ranks [i * max_rank, (i + 1) * max_rank)
of A and the matching columns of B, nonzero only on its own output rows, so
one pair of matmuls serves all of them. An adapter of a lower rank leaves
the rest of its ranks zero.

An eager step's rows are grouped by slot (`LoRAContext.batch`, set by the
model runner for the forward): per slot, y[rows] += (x[rows] A^T) B^T, as a
slice when the rows are contiguous, else gathered and scattered back. A
captured decode step (CUDA graph) cannot group on the host: it reads one
slot per row from a static device tensor (`LoRAContext.token_slots`, -1 for
none) in `token_add`, the Triton kernels on CUDA (parallel/lora_triton.py),
elsewhere `gathered_add`, the same product in torch ops (no host syncs:
emulated graphs on CPU). A row-parallel layer adds its partial term before
the all-reduce, which sums it with the others: (x A^T) B^T is linear in x's
column blocks.
"""
from collections.abc import Callable

import torch


def gathered_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """y += per row t with slots[t] >= 0: (x[t] a[slots[t]]^T) b[slots[t]]^T
    (lora_triton.add's contract), with each row's A and B gathered."""
    idx = slots.clamp(min=0).long()
    s = torch.bmm(a.index_select(0, idx), x.unsqueeze(-1)) * (slots >= 0).to(x.dtype)[:, None, None]
    y += torch.bmm(b.index_select(0, idx), s).squeeze(-1)
    return y


def token_add_for(device: torch.device) -> Callable:
    if device.type == "cuda":
        from parallel import lora_triton
        return lora_triton.add
    return gathered_add


class LoRAContext:
    """The step's rows per slot, shared by every LoRA layer of a model: None
    outside a forward with adapters, so captured graphs and steps without
    adapters run the base layers only."""

    def __init__(self, token_add: Callable = gathered_add):
        self.batch: list[tuple[int, slice | torch.Tensor]] | None = None
        self.token_slots: torch.Tensor | None = None     # captured steps: each row's slot (-1: none)
        self.token_add = token_add

    @property
    def active(self) -> bool:
        return self.batch is not None or self.token_slots is not None

    def set_rows(self, rows: list[tuple[int, int, int]], device: torch.device) -> None:
        """rows: (slot, first row, end row) per request with an adapter."""
        if not rows:
            self.batch = None
            return
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, a, b in rows:
            by_slot.setdefault(slot, []).append((a, b))
        batch = []
        for slot, spans in by_slot.items():
            spans.sort()
            if all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
                batch.append((slot, slice(spans[0][0], spans[-1][1])))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(device, non_blocking=True)
                batch.append((slot, idx))
        self.batch = batch


class LoRASlots:
    """One layer's adapter slots (module docstring)."""

    def __init__(self, ctx: LoRAContext, max_loras: int, max_rank: int, subs: int, input_size: int,
                 output_size: int, dtype: torch.dtype, device: torch.device):
        self.ctx = ctx
        self.max_rank = max_rank
        self.a = torch.zeros(max_loras, subs * max_rank, input_size, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, output_size, subs * max_rank, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set(self, slot: int, sub: int, offset: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Sub-projection `sub`'s adapter: a [r, this rank's input columns],
        b [its rows on this rank, r] (scaled), whose rows start at `offset`."""
        r = a.shape[0]
        if r > self.max_rank:
            raise ValueError(f"LoRA rank {r} is above max_lora_rank {self.max_rank}")
        k = sub * self.max_rank
        self.a[slot, k:k + r].copy_(a)
        self.b[slot, offset:offset + b.shape[0], k:k + r].copy_(b)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter term (in place)."""
        if self.ctx.token_slots is not None:
            return self.ctx.token_add(x, y, self.a, self.b, self.ctx.token_slots[:x.shape[0]])
        for slot, rows in self.ctx.batch:
            a, b = self.a[slot], self.b[slot]
            if isinstance(rows, slice) and y.dim() == 2:
                y[rows].addmm_(x[rows] @ a.t(), b.t())
            elif isinstance(rows, slice):       # (a layer called on [tokens, ..., features])
                y[rows] += (x[rows] @ a.t()) @ b.t()
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y
