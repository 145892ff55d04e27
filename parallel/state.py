"""The tensor-parallel group this process belongs to, and the two collectives
the model layers need.

Default is world size 1, rank 0: every collective is then the identity, so a
single-process run never touches torch.distributed. A launcher that has called
torch.distributed.init_process_group calls init_tp() once, before any model is
built (layers read the size and rank when they are constructed, to size their
shards).
"""
import torch
import torch.distributed as dist

_group: dist.ProcessGroup | None = None
_size: int = 1
_rank: int = 0


def init_tp(group: dist.ProcessGroup | None = None) -> None:
    """Use `group` (default: the whole world) as the tensor-parallel group."""
    global _group, _size, _rank
    if not dist.is_initialized():
        raise RuntimeError("init_tp needs torch.distributed.init_process_group first")
    _group = group
    _size = dist.get_world_size(group)
    _rank = dist.get_rank(group)


def reset_tp() -> None:
    """Back to a single process (tests, and after destroy_process_group)."""
    global _group, _size, _rank
    _group, _size, _rank = None, 1, 0


def get_tp_size() -> int:
    return _size


def get_tp_rank() -> int:
    return _rank


def get_tp_group() -> dist.ProcessGroup | None:
    return _group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the group, in place; returns x."""
    if _size > 1:
        dist.all_reduce(x, group=_group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim, in rank order."""
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous(), group=_group)
    return torch.cat(parts, dim=dim)
