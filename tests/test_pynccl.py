"""parallel/pynccl.py and parallel/communicator.py on CPU: where libnccl.so.2 is
looked for, the nccl.h enum values, argument checks, and the torch.distributed
communicator over two gloo ranks. The NCCL collectives themselves need a GPU:
tests/gpu/test_pynccl_gpu.py. Where an NCCL library is found (e.g. the
nvidia-nccl-cu13 wheel, or $TQSERVE_NCCL_LIBRARY), ncclGetVersion and
ncclGetUniqueId are called for real: both work without a GPU.
"""
import ctypes
import os
import subprocess
import sys
import tempfile
import traceback
import types

import pytest
import torch
import torch.distributed as dist

from parallel import pynccl
from parallel.communicator import Communicator, NcclCommunicator, TorchDistCommunicator
from parallel.pynccl import (NCCLLibrary, NcclUniqueId, PyNcclCommunicator, check_tensor, cuda_device,
                             decode_version, find_nccl_library, nccl_dtype, nccl_op, share_unique_id)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- library search
def _touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").close()
    return str(path)


@pytest.fixture
def search(monkeypatch, tmp_path):
    """A controlled world: no env vars, fake package folders, a loader that
    finds nothing unless told."""
    for var in pynccl.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    packages = {}                       # name -> folder, or an exception to raise

    def find_spec(name):
        found = packages.get(name)
        if isinstance(found, Exception):
            raise found
        return None if found is None else types.SimpleNamespace(submodule_search_locations=[found])

    loader = {"finds": False}
    monkeypatch.setattr(pynccl, "_find_spec", find_spec)
    monkeypatch.setattr(pynccl, "_loader_finds", lambda name: loader["finds"])
    return types.SimpleNamespace(packages=packages, loader=loader, tmp=tmp_path, env=monkeypatch)


def test_search_order(search):
    t = search.tmp
    mine = _touch(t / "mine" / "libnccl.so.2")
    vllm = _touch(t / "vllm" / "libnccl.so.2")
    wheel = _touch(t / "site" / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
    torch_lib = _touch(t / "site" / "torch" / "lib" / "libnccl.so.2")
    search.packages.update({"nvidia.nccl": str(t / "site" / "nvidia" / "nccl"), "torch": str(t / "site" / "torch")})
    search.loader["finds"] = True

    search.env.setenv("TQSERVE_NCCL_LIBRARY", mine)
    search.env.setenv("VLLM_NCCL_SO_PATH", vllm)
    assert find_nccl_library() == mine                      # 1. our variable
    search.env.setenv("TQSERVE_NCCL_LIBRARY", str(t / "mine"))
    assert find_nccl_library() == mine                      # ... or its folder
    search.env.delenv("TQSERVE_NCCL_LIBRARY")
    assert find_nccl_library() == vllm                      # 1b. vLLM's
    search.env.delenv("VLLM_NCCL_SO_PATH")
    assert find_nccl_library() == wheel                     # 2. the nvidia-nccl-cu1x wheel
    search.packages["nvidia.nccl"] = ModuleNotFoundError("No module named 'nvidia'")
    assert find_nccl_library() == torch_lib                 # 3. torch/lib
    os.remove(torch_lib)
    assert find_nccl_library() == "libnccl.so.2"            # 4. the dynamic loader


def test_nothing_found_is_one_clear_error(search):
    search.packages["torch"] = str(search.tmp / "torch")    # installed, but without NCCL
    with pytest.raises(RuntimeError) as e:
        find_nccl_library()
    msg = str(e.value)
    print(msg)
    for what in ("NCCL library not found", "$TQSERVE_NCCL_LIBRARY", "python package nvidia.nccl (not installed)",
                 os.path.join(str(search.tmp / "torch"), "lib", "libnccl.so.2"), "dynamic loader",
                 "pip install nvidia-nccl-cu13"):
        assert what in msg


def test_env_var_naming_a_missing_file_is_an_error(search):
    search.packages["nvidia.nccl"] = str(search.tmp)        # a wheel would be found ...
    _touch(search.tmp / "lib" / "libnccl.so.2")
    missing = str(search.tmp / "nope" / "libnccl.so.2")
    search.env.setenv("TQSERVE_NCCL_LIBRARY", missing)      # ... but an explicit setting is not skipped
    with pytest.raises(RuntimeError, match=r"\$TQSERVE_NCCL_LIBRARY is '.*nope/libnccl.so.2'"):
        find_nccl_library()


def test_wheel_found_as_namespace_package(monkeypatch, tmp_path):
    """The nvidia-nccl-cu13 wheel ships nvidia/nccl/ without __init__.py:
    the real importlib.util.find_spec must still locate it."""
    for var in pynccl.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    lib = _touch(tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2")
    before = {k for k in sys.modules if k == "nvidia" or k.startswith("nvidia.")}
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert find_nccl_library() == lib
    finally:
        for k in [k for k in sys.modules if (k == "nvidia" or k.startswith("nvidia.")) and k not in before]:
            del sys.modules[k]


# ---------------------------------------------------------------- nccl.h facts
def test_dtype_and_op_enums_match_nccl_h():
    # nccl.h (NVIDIA/nccl src/nccl.h.in; the nvidia-nccl-cu13 2.32.3 header says the same):
    #   typedef enum { ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclInt32 = 2, ncclInt = 2,
    #                  ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5, ncclFloat16 = 6, ncclHalf = 6,
    #                  ncclFloat32 = 7, ncclFloat = 7, ncclFloat64 = 8, ncclDouble = 8,
    #                  ncclBfloat16 = 9, ncclFloat8e4m3 = 10, ncclFloat8e5m2 = 11,
    #                  ncclNumTypes = 12 } ncclDataType_t;
    #   typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ... } ncclRedOp_t;
    # fp8 exists from NCCL 2.24.0 (PyTorch's NCCL_SUPPORTS_FP8 and nccl-tests' HAVE_FP8 both test >= 2.24.0).
    expected = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
                torch.float32: 7, torch.float64: 8, torch.bfloat16: 9, torch.float8_e4m3fn: 10,
                torch.float8_e5m2: 11}
    if hasattr(torch, "uint32"):
        expected.update({torch.uint32: 3, torch.uint64: 5})
    assert pynccl.NCCL_DTYPES == expected
    for dtype, code in expected.items():
        assert nccl_dtype(dtype) == code
    assert {op: nccl_op(op) for op in ("sum", "prod", "max", "min", "avg")} == \
        {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

    assert nccl_dtype(torch.float8_e4m3fn, (2, 24, 0)) == 10
    with pytest.raises(ValueError, match=r"NCCL 2.23.4 has no data type for torch.float8_e5m2"):
        nccl_dtype(torch.float8_e5m2, (2, 23, 4))
    assert nccl_dtype(torch.bfloat16, (2, 23, 4)) == 9
    for bad in (torch.bool, torch.complex64):
        with pytest.raises(ValueError, match="has no data type"):
            nccl_dtype(bad)
    with pytest.raises(ValueError, match="unknown reduce op 'mean'"):
        nccl_op("mean")


def test_version_code_and_unique_id_layout():
    assert decode_version(23203) == (2, 32, 3)     # NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z from 2.9
    assert decode_version(2708) == (2, 7, 8)       # X*1000 + Y*100 + Z before
    assert ctypes.sizeof(NcclUniqueId) == 128      # struct { char internal[NCCL_UNIQUE_ID_BYTES = 128]; }
    uid = NcclUniqueId.from_buffer_copy(bytes(range(128)))
    assert bytes(uid) == bytes(range(128))


def test_nccl_result_is_checked_with_error_string():
    lib = NCCLLibrary.__new__(NCCLLibrary)
    lib.path = "fake"
    lib.lib = types.SimpleNamespace(ncclGetErrorString=lambda r: b"invalid argument")
    lib._check(0, "ncclAllReduce")
    with pytest.raises(RuntimeError, match="ncclAllReduce failed: NCCL error 4: invalid argument"):
        lib._check(4, "ncclAllReduce")


def test_library_that_is_not_nccl_or_missing():
    with pytest.raises(RuntimeError, match="is not an NCCL 2 library: no ncclGetErrorString"):
        NCCLLibrary("libc.so.6")
    with pytest.raises(RuntimeError, match="(?s)cannot load NCCL library /nonexistent/libnccl.so.2.*nvidia-nccl-cu13"):
        NCCLLibrary("/nonexistent/libnccl.so.2")


def test_real_library_version_and_unique_id_without_gpu():
    """Load the NCCL library that find_nccl_library() finds (in a child
    process: ncclGetUniqueId starts NCCL's bootstrap listener thread)."""
    try:
        path = find_nccl_library()
    except RuntimeError:
        pytest.skip("no NCCL library found (pip install nvidia-nccl-cu13, or set TQSERVE_NCCL_LIBRARY, to run this)")
    code = ("from parallel.pynccl import NCCLLibrary\n"
            "lib = NCCLLibrary()\n"
            "uid = bytes(lib.get_unique_id())\n"
            "print(lib.path, lib.version_code, '.'.join(map(str, lib.version)), uid.hex(), lib.error_string(4), "
            "lib.has('ncclReduceScatter'), sep='|')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got_path, code_, version, uid, err4, has_rs = r.stdout.strip().splitlines()[-1].split("|")
    print(f"NCCL {version} from {got_path}")
    assert got_path == path
    major, minor, patch = map(int, version.split("."))
    assert (major, minor) >= (2, 10) and int(code_) == major * 10000 + minor * 100 + patch
    assert len(bytes.fromhex(uid)) == 128 and any(bytes.fromhex(uid))
    assert err4.startswith("invalid argument") and has_rs == "True"


# ---------------------------------------------------------------- argument checks
def test_tensor_and_device_checks():
    assert cuda_device(1) == torch.device("cuda", 1)
    assert cuda_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        cuda_device("cpu")
    with pytest.raises(ValueError, match=r"is on cpu, but the NCCL communicator is on cuda:0"):
        check_tensor(torch.zeros(4), torch.device("cuda", 0), "x")
    with pytest.raises(ValueError, match=r"not contiguous"):
        check_tensor(torch.zeros(4, 3).t(), torch.device("cpu"), "x")   # device matches; stride does not
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        check_tensor([1.0], torch.device("cuda", 0), "x")


@pytest.fixture
def world1(tmp_path):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_nccl_communicator_refuses_cpu_tensors(world1):
    """One rank: no NCCL library is loaded and no communicator made, but the
    arguments are checked as with many."""
    comm = NcclCommunicator(world1, "cuda:0")
    assert isinstance(comm, Communicator) and comm.world_size == 1 and comm.pynccl.comm is None
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"all_reduce tensor is on cpu, but the NCCL communicator is on cuda:0"):
        comm.all_reduce(x)
    with pytest.raises(ValueError, match=r"all_gather tensor is on cpu, but the NCCL communicator is on cuda:0"):
        comm.all_gather(x, dim=0)
    p = comm.pynccl
    for call in (lambda: p.all_reduce(x), lambda: p.all_gather(torch.empty(6), x), lambda: p.broadcast(x, 0),
                 lambda: p.reduce_scatter(torch.empty(6), x)):
        with pytest.raises(ValueError, match="is on cpu"):
            call()
    comm.close()
    with pytest.raises(ValueError, match="CUDA device"):
        PyNcclCommunicator(world1, "cpu")


class _FakePyNccl:
    """Stands in for PyNcclCommunicator: `world` ranks whose x is rank*100 + x."""
    def __init__(self, world):
        self.world_size, self.rank, self.comm, self.device = world, 0, object(), torch.device("cpu")

    def all_gather(self, out, inp):
        for r in range(self.world_size):
            out[r].copy_(inp + 100 * r)
        return out


def test_nccl_all_gather_layout_equals_cat():
    """NcclCommunicator gathers into [world, *x.shape] and moves the rank axis
    into place: the result must be torch.cat of the ranks' x along dim."""
    comm = NcclCommunicator.__new__(NcclCommunicator)
    comm.pynccl = _FakePyNccl(3)
    comm.device, comm.world_size, comm.rank = torch.device("cpu"), 3, 0
    x = torch.arange(2 * 4 * 5, dtype=torch.float32).reshape(2, 4, 5)
    parts = [x + 100 * r for r in range(3)]
    for dim in (0, 1, 2, -1, -2, -3):
        assert torch.equal(comm.all_gather(x, dim), torch.cat(parts, dim)), dim
    assert torch.equal(comm.all_gather(x.transpose(0, 2), 1), torch.cat([p.transpose(0, 2) for p in parts], 1))
    with pytest.raises(ValueError, match="out of range"):
        comm.all_gather(x, 3)


# ---------------------------------------------------------------- two gloo ranks
def _rank_tensor(rank, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else \
        torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _torchdist_worker(rank, world, init_file, out_file, with_nccl):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        comm = TorchDistCommunicator()
        assert (comm.rank, comm.world_size) == (rank, world)
        shape = (3, 4, 5)
        for dtype in (torch.float32, torch.int64):
            x = _rank_tensor(rank, shape, dtype)
            want = sum(_rank_tensor(r, shape, dtype) for r in range(world))
            got = comm.all_reduce(x)
            assert got is x and torch.allclose(x, want, atol=1e-6), f"all_reduce {dtype}"
        y = _rank_tensor(rank, (4, 6)).t()                     # not contiguous: reduced through a copy
        comm.all_reduce(y)
        assert torch.allclose(y, sum(_rank_tensor(r, (4, 6)) for r in range(world)).t(), atol=1e-6)
        x = _rank_tensor(rank, shape)
        parts = [_rank_tensor(r, shape) for r in range(world)]
        for dim in (0, 1, -1):
            got = comm.all_gather(x, dim)
            assert torch.equal(got, torch.cat(parts, dim)), f"all_gather dim {dim}"
        got = comm.all_gather(x.transpose(1, 2), -1)
        assert torch.equal(got, torch.cat([p.transpose(1, 2) for p in parts], -1)), "non-contiguous all_gather"
        if with_nccl:                                          # the NCCL id travels over gloo
            uid = bytes(share_unique_id(NCCLLibrary(), dist.group.WORLD))
            ids = [None] * world
            dist.all_gather_object(ids, uid)
            assert len(uid) == 128 and any(uid) and ids == [uid] * world, "unique id differs"
        dist.destroy_process_group()
        result = "ok"
    except BaseException:
        result = traceback.format_exc()
    with open(out_file, "w") as f:
        f.write(result)


def test_torch_dist_communicator_two_gloo_ranks():
    """all_reduce / all_gather over two spawned gloo ranks equal a sum / cat
    computed locally; where an NCCL library is found, the NCCL unique id is
    also shared over the gloo group as PyNcclCommunicator does."""
    import torch.multiprocessing as mp

    world = 2
    try:
        find_nccl_library()
        with_nccl = True
    except RuntimeError:
        with_nccl = False
    print(f"sharing an NCCL unique id over gloo too: {with_nccl}")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.txt") for r in range(world)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_torchdist_worker,
                             args=(r, world, os.path.join(tmp, "init"), outs[r], with_nccl))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
            assert os.path.exists(outs[r]), f"rank {r} wrote nothing (exit code {p.exitcode})"
            with open(outs[r]) as f:
                result = f.read()
            assert result == "ok", f"rank {r}:\n{result}"
            assert p.exitcode == 0, f"rank {r} exit code {p.exitcode}"
