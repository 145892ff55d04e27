"""Tensor-parallel linear and embedding layers.

Each layer allocates only this rank's shard and knows how to cut it out of a
full checkpoint tensor: `weight_loader(param, loaded_weight, shard_id=None)`
is set on every parameter, so a model's load loop calls
`param.weight_loader(param, hf_tensor[, shard_id])` without knowing the layout.

Megatron layout: column-parallel layers (q/k/v, gate/up) split their output
features and need no communication; the row-parallel layer after them
(o_proj, down_proj) splits its input features and all-reduces its partial
sums. The vocabulary is split into contiguous ranges for the embedding (masked
lookup + all-reduce) and the head (local logits + all-gather).
"""
import torch
import torch.nn.functional as F
from torch import nn

from parallel.int4 import pack_int4
from parallel.lora import LoRAContext, LoRASlots
from parallel.quant.base import DENSE, GGUFBlocks, Int4Cpu, QuantizedTensor, QuantMethod
from parallel.quant.gguf import QTYPES
from parallel.state import all_gather, all_reduce, get_tp_rank, get_tp_size


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


def _check(loaded, *full_shape: int):
    """The checkpoint tensor (dense or a QuantizedTensor) must have the whole
    (unsharded) shape."""
    if tuple(loaded.shape) != full_shape:
        raise ValueError(f"shape mismatch: expected {full_shape}, got {tuple(loaded.shape)}")
    return loaded


def _zero_padded(part, rows: int):
    """A rank's vocabulary rows followed by zero rows up to `rows`."""
    if part.shape[0] == rows:
        return part
    if isinstance(part, QuantizedTensor):
        return part.zero_padded(rows)
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])


class QuantStorage:
    """What lets a layer hand its weight to a quant method that stores it in
    the checkpoint's own format (parallel/quant/base.py): the dense weight
    becomes an empty placeholder that still routes checkpoint tensors here.
    A layer's weight_loader cuts this rank's part out of the checkpoint
    tensor, dense or QuantizedTensor alike (both have .shape and .narrow),
    and _store puts it in the dense weight or the quant method."""
    splits_columns = False      # row-parallel: each rank holds some input columns

    def use_quant(self, method: QuantMethod) -> None:
        """Call on the meta-built model, before it is materialised: the dense
        weight is never allocated."""
        if self.tp_size > 1 and not method.shards_across_ranks:
            raise ValueError(f"quantization {method.name} is not supported with tensor parallelism yet")
        self.quant = method
        loader = self.weight.weight_loader
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device),
                                   requires_grad=False)
        self.weight.weight_loader = loader

    def use_gguf(self, qtypes=()) -> None:
        """Keep GGUF rows of the types `qtypes`. A row-parallel rank's columns
        must be whole blocks of each: checked here, on the meta-built model,
        before any rank waits on another."""
        rows, cols = self.weight.shape
        for qtype in qtypes if self.splits_columns and self.tp_size > 1 else ():
            block = QTYPES[qtype].block       # the loader offers kernel types only
            if cols % block:
                raise ValueError(f"GGUF {qtype}: {cols * self.tp_size} input columns split over {self.tp_size} "
                                 f"tensor-parallel ranks are {cols} per rank, not a multiple of its "
                                 f"{block}-element blocks")
        self.use_quant(GGUFBlocks(rows, cols))

    def _store(self, param: nn.Parameter, shard_id, offset: int, part) -> None:
        """This rank's part of a checkpoint tensor into `param` from row `offset`."""
        if param is self.weight and self.quant is not DENSE:
            self.quant.load(shard_id, offset, part, param.device, param.dtype)
        else:
            param.data.narrow(0, offset, part.shape[0]).copy_(part)


class LinearBase(QuantStorage, nn.Module):
    """y = x W^T + b with W [output_size, input_size] of this rank's shard;
    `quant` (parallel/quant/base.py) holds W and multiplies by it."""

    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__()
        self.tp_size = get_tp_size()
        self.tp_rank = get_tp_rank()
        self.input_size, self.output_size = input_size, output_size     # this rank's
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.quant: QuantMethod = DENSE
        self.lora: LoRASlots | None = None      # adapters (parallel/lora.py), when enabled

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        self._store(param, shard_id, *self.rank_part(param, loaded_weight, shard_id))

    lora_subs = 1       # sub-projections an adapter may target separately (fused layers: q/k/v, gate/up)

    def _rows(self, shard_id) -> tuple[int, int, int, int]:
        """Where shard_id's output rows go: (first row of this rank's weight,
        rows, first row of them in the checkpoint tensor, its rows)."""
        n = self.output_size
        return 0, n, 0, n

    def rank_part(self, param: nn.Parameter, loaded, shard_id) -> tuple[int, object]:
        """(first row of param it fills, this rank's part of the checkpoint tensor `loaded`)."""
        offset, n, start, full = self._rows(shard_id)
        _check(loaded, full, *self._cols(param))
        return offset, (loaded if n == full else loaded.narrow(0, start, n))

    def enable_lora(self, ctx: LoRAContext, max_loras: int, max_rank: int, dtype: torch.dtype,
                    device: torch.device) -> None:
        self.lora = LoRASlots(ctx, max_loras, max_rank, self.lora_subs, self.input_size, self.output_size,
                              dtype, device)

    def lora_sub(self, shard_id) -> int:
        return 0

    def lora_parts(self, shard_id, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """An adapter's A [r, input] and scaled B [output, r] of the whole
        (unsharded) sub-projection shard_id: (sub, first row, this rank's A,
        this rank's B). Raises ValueError on a shape that does not fit."""
        offset, n, start, full = self._rows(shard_id)
        _check(b, full, a.shape[0])
        _check(a, a.shape[0], self.input_size * (self.tp_size if self.splits_columns else 1))
        return self.lora_sub(shard_id), offset, self._lora_cols(a), (b if n == full else b.narrow(0, start, n))

    def _lora_cols(self, a: torch.Tensor) -> torch.Tensor:
        return a

    def _cols(self, param: nn.Parameter) -> tuple[int, ...]:
        """The checkpoint tensor's trailing shape for param: the weight's columns, none for the bias."""
        return (self.input_size,) if param is self.weight else ()

    def pack_int4(self, dtype: torch.dtype) -> bool:
        """Switch to the int4 kernel (activations in dtype) if the loaded
        weight, still in fp32, is exactly 4-bit."""
        if self.quant is not DENSE:
            return False
        w = pack_int4(self.weight, dtype)
        if w is not None:
            self.quant, self.weight = Int4Cpu(w), None
        return w is not None

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is DENSE:
            y = F.linear(x, self.weight, bias)
        else:
            y = self.quant.matmul(self, x)
            y = y if bias is None else y + bias
        if self.lora is not None and self.lora.ctx.active:
            y = self.lora.add(x, y)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole matrix."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, _divide(output_size, get_tp_size(), "output size"), bias)

    def _rows(self, shard_id):
        n = self.output_size
        return 0, n, self.tp_rank * n, n * self.tp_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj).

    Each rank's weight is [its shard of output 0; its shard of output 1; ...],
    so the per-rank output can be split with .chunk() after the matmul.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        for n in output_sizes:
            _divide(n, get_tp_size(), "output size")
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    @property
    def lora_subs(self) -> int:
        return len(self.output_sizes)

    def lora_sub(self, shard_id) -> int:
        return shard_id

    def _rows(self, shard_id):
        tp = self.tp_size
        size = self.output_sizes[shard_id] // tp
        return sum(self.output_sizes[:shard_id]) // tp, size, self.tp_rank * size, self.output_sizes[shard_id]


class QKVParallelLinear(LinearBase):
    """q_proj, k_proj and v_proj fused, split by attention head.

    Each rank gets num_heads / tp query heads and the KV heads they read. When
    there are fewer KV heads than ranks, each KV head is replicated on
    tp / num_kv_heads consecutive ranks (so GQA groups stay on one rank).
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "number of attention heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = _divide(total_num_kv_heads, tp, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, total_num_kv_heads, "tp over KV heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    lora_subs = 3

    def lora_sub(self, shard_id) -> int:
        return "qkv".index(shard_id)

    def _rows(self, shard_id):
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank * self.q_size, self.total_num_heads * self.head_dim
        if shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            start = (self.tp_rank // self.kv_replicas) * self.kv_size
            return offset, self.kv_size, start, self.total_num_kv_heads * self.head_dim
        raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed by all-reduce."""
    splits_columns = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(_divide(input_size, get_tp_size(), "input size"), output_size, bias)

    def rank_part(self, param, loaded, shard_id):
        if param is not self.weight:        # bias: whole, added once (on rank 0) after the sum
            return 0, _check(loaded, self.output_size)
        n = self.input_size
        _check(loaded, self.output_size, n * self.tp_size)
        return 0, loaded.narrow(1, self.tp_rank * n, n)

    def _lora_cols(self, a: torch.Tensor) -> torch.Tensor:
        n = self.input_size
        return a.narrow(1, self.tp_rank * n, n)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, not yet all-reduced (for a caller that sums
        several of them at once, as an MoE block does)."""
        return self._matmul(x, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y)


class VocabParallelEmbedding(QuantStorage, nn.Module):
    """Embedding table split into contiguous vocabulary ranges.

    Each rank holds ceil(vocab / tp) rows; the last rank's tail rows are zero
    padding that no token id reaches.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_size = get_tp_size()
        self.tp_rank = get_tp_rank()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quant: QuantMethod = DENSE

    def weight_loader(self, param, loaded_weight, shard_id=None):
        _check(loaded_weight, self.num_embeddings, self.embedding_dim)
        part = loaded_weight.narrow(0, self.vocab_start, self.vocab_end - self.vocab_start)
        self._store(param, shard_id, 0, _zero_padded(part, self.rows_per_rank))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is DENSE:
            return F.embedding(ids, self.weight)
        return self.quant.embed(ids, self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = self._lookup((input_ids - self.vocab_start) * mine)
        y = y * mine.unsqueeze(-1).to(y.dtype)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocabulary: local logits, then all-gather.

    Shares the embedding's layout, so tied embeddings can share the Parameter.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight) if self.quant is DENSE else self.quant.matmul(self, hidden)
        if self.tp_size > 1:
            logits = all_gather(logits, dim=-1)[..., :self.num_embeddings]
        return logits
