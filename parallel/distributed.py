"""Joining the tensor-parallel ranks: rendezvous, process groups, communicator.

Ranks are numbered node by node: node n runs ranks n * per_node ..
(n + 1) * per_node - 1, so rank 0 (the leader: HTTP, scheduler, sampling) is
on node 0. Every rank rendezvouses at master_addr:master_port (rank 0's TCP
store) over gloo, then makes the group the model and the step plans use.

Two timeouts: the rendezvous and the startup agreements wait long (the other
node may still be loading a large checkpoint); every collective after startup
waits `timeout` seconds, so a rank that died or hangs makes the others fail
with an error instead of waiting for ever. The leader sends a heartbeat plan
while idle so that followers waiting for the next step do not time out.

GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (the interface of the link between
the boxes) are read by gloo and NCCL themselves.
"""
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel import state

log = logging.getLogger("tqserve.parallel")

STARTUP_TIMEOUT_S = 900


@dataclass(frozen=True)
class Topology:
    """Where one rank sits: tp_size ranks over nnodes nodes."""
    tp_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")

    @property
    def per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)


def init_distributed(topo: Topology, rank: int, device: torch.device, timeout_s: float) -> None:
    """Join the group as `rank`; afterwards parallel.state holds the TP group
    and the model layers built from now on take their shard."""
    local = rank - topo.node_ranks.start
    if device.type == "cuda":
        device = torch.device("cuda", local if device.index is None else device.index)
        torch.cuda.set_device(device)
    ifnames = {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if os.environ.get(k)}
    log.info("rank %d of %d (node %d): rendezvous at %s:%d%s", rank, topo.tp_size, topo.node_rank,
             topo.master_addr, topo.master_port, f" ({ifnames})" if ifnames else "")
    dist.init_process_group("gloo", init_method=f"tcp://{topo.master_addr}:{topo.master_port}",
                            rank=rank, world_size=topo.tp_size, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    comm = None
    if device.type == "cuda":
        from parallel.communicator import NcclCommunicator
        comm = NcclCommunicator(group, device)
    state.init_tp(group, comm)
    log.info("rank %d: joined (%s collectives, %gs timeout)", rank,
             "NCCL" if comm is not None else "gloo", timeout_s)


def agree(value, src: int = 0):
    """Rank src's value on every rank, over the startup group (long timeout)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def startup_done() -> None:
    """Every rank is built (a barrier with the startup timeout): from here on
    the short timeout applies, so no rank may still be loading."""
    dist.barrier()


def min_over_ranks(x: int) -> int:
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def shutdown_distributed() -> None:
    state.reset_tp()
    if dist.is_initialized():
        dist.destroy_process_group()
