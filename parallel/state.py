"""The tensor-parallel group this process belongs to, and the two collectives
the model layers need.

Default is world size 1, rank 0: every collective is then the identity, so a
single-process run never touches torch.distributed. A launcher that has called
torch.distributed.init_process_group calls init_tp() once, before any model is
built (layers read the size and rank when they are constructed, to size their
shards).
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist

_group: dist.ProcessGroup | None = None
_size: int = 1
_rank: int = 0
_comm = None        # the model's collectives (parallel.communicator.Communicator) when size > 1


def init_tp(group: dist.ProcessGroup | None = None, communicator=None) -> None:
    """Use `group` (default: the whole world) as the tensor-parallel group.

    communicator: what runs the model's all-reduce / all-gather
    (parallel.communicator: NCCL through ctypes on CUDA, capturable in CUDA
    graphs); None: torch.distributed on `group` (gloo on the CPU)."""
    from parallel.communicator import TorchDistCommunicator
    global _group, _size, _rank, _comm
    if not dist.is_initialized():
        raise RuntimeError("init_tp needs torch.distributed.init_process_group first")
    _group = group
    _size = dist.get_world_size(group)
    _rank = dist.get_rank(group)
    _comm = communicator or TorchDistCommunicator(group)


def reset_tp() -> None:
    """Back to a single process (tests, and after destroy_process_group)."""
    global _group, _size, _rank, _comm
    if _comm is not None:
        _comm.close()
    _group, _size, _rank, _comm = None, 1, 0, None


@contextmanager
def assume_tp(size: int, rank: int = 0):
    """Layers built inside see this size and rank without any process group:
    building a model on the meta device this way checks that it shards
    (head counts divide) before any rank waits on another."""
    global _size, _rank
    old = _size, _rank
    _size, _rank = size, rank
    try:
        yield
    finally:
        _size, _rank = old


def get_tp_size() -> int:
    return _size


def get_tp_rank() -> int:
    return _rank


def get_tp_group() -> dist.ProcessGroup | None:
    return _group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the group, in place; returns x."""
    return _comm.all_reduce(x) if _size > 1 else x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim, in rank order."""
    return _comm.all_gather(x, dim) if _size > 1 else x


def broadcast_object(obj=None, src: int = 0):
    """Rank src's picklable obj on every rank (over the group's gloo
    transport: the leader's step plans, startup agreements)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_group)
    return box[0]


def ping() -> None:
    """A round trip through every rank (a one-element all-reduce over the
    group's transport): returns only when every rank is alive and here."""
    if _size > 1:
        dist.all_reduce(torch.zeros(1), group=_group)
