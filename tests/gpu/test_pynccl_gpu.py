"""parallel/pynccl.py on one GPU: the ctypes bindings for real, through a
one-rank NCCL communicator (nccl_at_world_1=True; two ranks on one GPU are not
supported by NCCL), and a CUDA graph that captures the collectives and
replays them. Skipped, with the reason printed (pytest -ra), without a CUDA
device or an NCCL library (torch's CUDA wheels bring nvidia-nccl-cu1x).
"""
import os

import pytest
import torch
import torch.distributed as dist

from parallel.communicator import NcclCommunicator
from parallel.pynccl import PyNcclCommunicator, find_nccl_library

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: torch.cuda.is_available() is False")

DEV = torch.device("cuda", 0)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64]


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo group (on loopback: the machine may have no network)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'init'}",
                            rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
    if saved is None:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = saved


@pytest.fixture(scope="module")
def comm(group):
    try:
        path = find_nccl_library()
    except RuntimeError as e:
        pytest.skip(str(e).replace("\n", " "))
    c = PyNcclCommunicator(group, DEV, nccl_at_world_1=True)
    print(f"NCCL {'.'.join(map(str, c.version))} from {path}")
    yield c
    c.close()


def test_world_1_without_nccl_is_a_no_op(group):
    c = PyNcclCommunicator(group, DEV)
    assert c.comm is None and c.nccl is None
    x = torch.randn(5, 7, device=DEV)
    ref = x.clone()
    assert c.all_reduce(x) is x and torch.equal(x, ref)
    out = torch.empty(1, 5, 7, device=DEV)
    assert torch.equal(c.all_gather(out, x)[0], ref)
    assert torch.equal(c.broadcast(x, 0), ref)
    with pytest.raises(ValueError, match="is on cpu"):
        c.all_reduce(torch.ones(3))
    with pytest.raises(ValueError, match="not contiguous"):
        c.all_reduce(x.t())


def test_one_rank_collectives(comm):
    g = torch.Generator(device=DEV).manual_seed(0)
    for dtype in DTYPES:
        x = (torch.randn(4099, device=DEV, generator=g) * 20).to(dtype)
        ref = x.clone()
        for op in ("sum", "max", "min", "prod") + (("avg",) if dtype.is_floating_point else ()):
            comm.all_reduce(x, op=op)
            assert torch.equal(x, ref), (dtype, op)
        out = torch.full((1, 4099), 7, dtype=dtype, device=DEV)
        comm.all_gather(out, x)
        assert torch.equal(out[0], ref), dtype
        comm.broadcast(x, src=0)
        assert torch.equal(x, ref), dtype
        rs = torch.zeros_like(x)
        comm.reduce_scatter(rs, x)
        assert torch.equal(rs, ref), dtype
    # gather / broadcast move bytes: any dtype works, NCCL arithmetic or not
    b = torch.rand(33, device=DEV) > 0.5
    out = torch.zeros(1, 33, dtype=torch.bool, device=DEV)
    assert torch.equal(comm.all_gather(out, b)[0], b)
    f8 = torch.randn(64, device=DEV).to(torch.float8_e4m3fn)
    out = torch.zeros(1, 64, dtype=torch.float8_e4m3fn, device=DEV)
    assert torch.equal(comm.all_gather(out, f8)[0].view(torch.uint8), f8.view(torch.uint8))
    torch.cuda.synchronize()


def test_communicator_interface_on_nccl(group, comm):
    c = NcclCommunicator.__new__(NcclCommunicator)      # share the module's communicator
    c.pynccl, c.device, c.rank, c.world_size = comm, comm.device, 0, 1
    x = torch.randn(3, 4, 5, device=DEV)
    for dim in (0, 1, -1):
        assert torch.equal(c.all_gather(x, dim), x)
    y = x.clone()
    assert c.all_reduce(y) is y and torch.equal(y, x)
    with pytest.raises(ValueError, match="is on cpu"):
        c.all_gather(torch.ones(2, 2), 0)


def test_cuda_graph_captures_and_replays(comm):
    x = torch.zeros(1 << 16, device=DEV)
    out = torch.zeros(1, 1 << 16, device=DEV)
    y = torch.zeros_like(x)

    def step():
        y.copy_(x * 2)
        comm.all_reduce(y)
        comm.all_gather(out, y)
        y.add_(1)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):              # warm up outside the graph, as torch's docs advise
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for v in (1.0, 3.0, -2.5):
        x.fill_(v)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(out == 2 * v) and torch.all(y == 2 * v + 1), v
