"""The two collectives the tensor-parallel layers need, behind one small
interface, so the transport can be chosen per run:

- TorchDistCommunicator: torch.distributed collectives on a process group
  (gloo on CPU; also any backend torch.distributed has).
- NcclCommunicator: NCCL through ctypes (parallel/pynccl.py) on one CUDA
  device, issued on the current stream, so a CUDA graph can capture it.

Both: all_reduce(x) sums x over the ranks in place and returns x;
all_gather(x, dim) returns every rank's x concatenated along dim in rank
order. With one rank both are the identity.
"""
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from parallel.pynccl import PyNcclCommunicator, check_device


class Communicator(ABC):
    rank: int = 0
    world_size: int = 1

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x (same shape on all) concatenated along dim, in rank order."""

    def close(self) -> None:
        """Release what the communicator holds (no-op by default)."""


def _gather_dim(x: torch.Tensor, dim: int) -> int:
    if x.dim() == 0:
        raise ValueError("all_gather needs a tensor with at least one dimension")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"all_gather dim {dim} is out of range for a {x.dim()}-d tensor")
    return dim % x.dim()


def _in_place(x: torch.Tensor, reduce) -> torch.Tensor:
    """Run an in-place collective on x, through a contiguous copy if x is not
    contiguous (then written back)."""
    if x.is_contiguous():
        reduce(x)
    else:
        tmp = x.contiguous()
        reduce(tmp)
        x.copy_(tmp)
    return x


class TorchDistCommunicator(Communicator):
    """torch.distributed collectives over `group` (None: the whole world)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        return _in_place(x, lambda t: dist.all_reduce(t, group=self.group))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        dim = _gather_dim(x, dim)
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


class NcclCommunicator(Communicator):
    """NCCL over the ranks of `group` (a gloo group, used once to share the
    NCCL id) on `device`; tensors must live on that device (ValueError
    otherwise, also with one rank)."""

    def __init__(self, group: dist.ProcessGroup | None, device, **kw):
        self.pynccl = PyNcclCommunicator(group, device, **kw)
        self.device = self.pynccl.device
        self.rank = self.pynccl.rank
        self.world_size = self.pynccl.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        check_device(x, self.device, "all_reduce tensor")
        return _in_place(x, self.pynccl.all_reduce)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        dim = _gather_dim(x, dim)
        check_device(x, self.device, "all_gather tensor")
        x = x.contiguous()
        if self.world_size == 1 and self.pynccl.comm is None:
            return x
        n = self.world_size
        buf = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        self.pynccl.all_gather(buf, x)
        # buf[r] is rank r's x: put the rank axis just before dim and merge the
        # two, so rank r's slice comes r-th along dim (= torch.cat(buf, dim)).
        shape = (*x.shape[:dim], n * x.shape[dim], *x.shape[dim + 1:])
        return buf.reshape(shape) if dim == 0 else buf.movedim(0, dim).reshape(shape)

    def close(self) -> None:
        self.pynccl.close()
