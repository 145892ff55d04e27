"""NCCL through ctypes: a communicator whose collectives run on the current
CUDA stream, so they can be captured in CUDA graphs (vLLM's
PyNcclCommunicator pattern).

torch.distributed's NCCL backend is not used: the unique id that lets the
ranks find each other travels over a CPU (gloo) process group, and the
collectives are plain ncclAllReduce / ncclAllGather / ncclBroadcast calls on
pointers, with no host synchronisation and no allocation.

    comm = PyNcclCommunicator(gloo_group, torch.device("cuda", local_rank))
    comm.all_reduce(x)            # in place, sum
    comm.all_gather(out, x)       # out: world_size * x.numel() elements
    comm.broadcast(x, src=0)
    comm.close()

The library is libnccl.so.2, found by find_nccl_library(); nothing here needs
a GPU until a communicator is created.
"""
import ctypes
import importlib.util
import os

import torch
import torch.distributed as dist

SONAME = "libnccl.so.2"
ENV_VARS = ("TQSERVE_NCCL_LIBRARY", "VLLM_NCCL_SO_PATH")
INSTALL_HINT = ("pip install nvidia-nccl-cu13 (nvidia-nccl-cu12 for a CUDA 12 torch), "
                "or set TQSERVE_NCCL_LIBRARY=/path/to/libnccl.so.2")

_find_spec = importlib.util.find_spec     # a module attribute so that tests can replace it


def _package_dirs(name: str) -> list[str]:
    """The folders of an installed package (several for a namespace package
    such as nvidia.nccl), found without importing it."""
    try:
        spec = _find_spec(name)
    except (ImportError, ValueError):     # e.g. parent package `nvidia` absent
        return []
    if spec is None:
        return []
    return list(spec.submodule_search_locations or [])


def _loader_finds(name: str) -> bool:
    """Whether the dynamic loader (LD_LIBRARY_PATH, ldconfig cache) resolves name."""
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def find_nccl_library() -> str:
    """The path of libnccl.so.2, searched in this order:

    1. $TQSERVE_NCCL_LIBRARY, then vLLM's $VLLM_NCCL_SO_PATH (the file, or a
       folder holding it); a value that names no file is an error, not skipped;
    2. the nvidia-nccl-cu13 / nvidia-nccl-cu12 wheels (both install the
       package nvidia.nccl with lib/libnccl.so.2);
    3. torch's own lib/ folder (source and conda builds put it there);
    4. the bare soname, if the dynamic loader resolves it (then it is returned
       as "libnccl.so.2").
    """
    for var in ENV_VARS:
        value = os.environ.get(var)
        if not value:
            continue
        path = os.path.join(value, SONAME) if os.path.isdir(value) else value
        if not os.path.isfile(path):
            raise RuntimeError(f"NCCL library not found: ${var} is {value!r}, which is not a file "
                               f"(nor a folder holding {SONAME}); correct or unset it")
        return path
    searched = [f"${v} (unset)" for v in ENV_VARS]
    for package in ("nvidia.nccl", "torch"):
        dirs = _package_dirs(package)
        if not dirs:
            searched.append(f"python package {package} (not installed)")
        for d in dirs:
            path = os.path.join(d, "lib", SONAME)
            if os.path.isfile(path):
                return path
            searched.append(path)
    if _loader_finds(SONAME):
        return SONAME
    searched.append(f"{SONAME} through the dynamic loader (LD_LIBRARY_PATH, ldconfig)")
    raise RuntimeError("NCCL library not found; searched:\n  " + "\n  ".join(searched)
                       + f"\nFix: {INSTALL_HINT}")


# ---------------------------------------------------------------- nccl.h facts
# Values from NCCL's src/nccl.h.in (NVIDIA/nccl; identical in the header of the
# nvidia-nccl-cu13 2.32.3 wheel):
#   ncclResult_t:   ncclSuccess = 0, ... ncclInProgress = 7, ncclTimeout = 8
#   ncclDataType_t: ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3,
#                   ncclInt64 = 4, ncclUint64 = 5, ncclFloat16 = 6, ncclFloat32 = 7,
#                   ncclFloat64 = 8, ncclBfloat16 = 9, ncclFloat8e4m3 = 10,
#                   ncclFloat8e5m2 = 11 (the two fp8 types since NCCL 2.24.0)
#   ncclRedOp_t:    ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4
#   ncclUniqueId:   struct { char internal[128]; }, passed by value to ncclCommInitRank
#   NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z from 2.9 on (X*1000 + Y*100 + Z before)
NCCL_SUCCESS = 0
NCCL_UNIQUE_ID_BYTES = 128

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32 = 0, 1, 2, 3
NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_FLOAT32 = 4, 5, 6, 7
NCCL_FLOAT64, NCCL_BFLOAT16, NCCL_FLOAT8E4M3, NCCL_FLOAT8E5M2 = 8, 9, 10, 11
FP8_MIN_VERSION = (2, 24, 0)

NCCL_DTYPES: dict[torch.dtype, int] = {
    torch.int8: NCCL_INT8,
    torch.uint8: NCCL_UINT8,
    torch.int32: NCCL_INT32,
    torch.int64: NCCL_INT64,
    torch.float16: NCCL_FLOAT16,
    torch.float32: NCCL_FLOAT32,
    torch.float64: NCCL_FLOAT64,
    torch.bfloat16: NCCL_BFLOAT16,
    torch.float8_e4m3fn: NCCL_FLOAT8E4M3,
    torch.float8_e5m2: NCCL_FLOAT8E5M2,
}
for _name, _code in (("uint32", NCCL_UINT32), ("uint64", NCCL_UINT64)):
    if hasattr(torch, _name):
        NCCL_DTYPES[getattr(torch, _name)] = _code
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def nccl_dtype(dtype: torch.dtype, version: tuple[int, int, int] | None = None) -> int:
    """ncclDataType_t of a torch dtype (for a library of `version`; None:
    assume a recent one). ValueError if NCCL has no such type."""
    code = NCCL_DTYPES.get(dtype)
    if code is None or (dtype in _FP8 and version is not None and version < FP8_MIN_VERSION):
        have = f" {'.'.join(map(str, version))}" if version else ""
        raise ValueError(f"NCCL{have} has no data type for {dtype}")
    return code


def nccl_op(op: str) -> int:
    """ncclRedOp_t of "sum", "prod", "max", "min" or "avg"."""
    try:
        return NCCL_OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reduce op {op!r}: expected one of {sorted(NCCL_OPS)}") from None


def decode_version(code: int) -> tuple[int, int, int]:
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


_result_t = ctypes.c_int
_comm_t = ctypes.c_void_p
_stream_t = ctypes.c_void_p
_buf = ctypes.c_void_p
_size = ctypes.c_size_t
_int = ctypes.c_int

# name -> (restype, argtypes); the signatures of nccl.h.
_FUNCTIONS = {
    "ncclGetErrorString": (ctypes.c_char_p, [_result_t]),
    "ncclGetVersion": (_result_t, [ctypes.POINTER(_int)]),
    "ncclGetUniqueId": (_result_t, [ctypes.POINTER(NcclUniqueId)]),
    # (ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank)
    "ncclCommInitRank": (_result_t, [ctypes.POINTER(_comm_t), _int, NcclUniqueId, _int]),
    # (sendbuff, recvbuff, count, datatype, op, comm, stream)
    "ncclAllReduce": (_result_t, [_buf, _buf, _size, _int, _int, _comm_t, _stream_t]),
    # (sendbuff, recvbuff, sendcount, datatype, comm, stream)
    "ncclAllGather": (_result_t, [_buf, _buf, _size, _int, _comm_t, _stream_t]),
    # (sendbuff, recvbuff, count, datatype, root, comm, stream)
    "ncclBroadcast": (_result_t, [_buf, _buf, _size, _int, _int, _comm_t, _stream_t]),
    "ncclCommDestroy": (_result_t, [_comm_t]),
}
_OPTIONAL = {
    # (sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
    "ncclReduceScatter": (_result_t, [_buf, _buf, _size, _int, _int, _comm_t, _stream_t]),
    "ncclGetLastError": (ctypes.c_char_p, [_comm_t]),      # NCCL >= 2.13
}


class NCCLLibrary:
    """ctypes bindings of libnccl.so.2; every call's ncclResult_t is checked
    (RuntimeError with ncclGetErrorString's text). One CDLL per path."""

    _loaded: dict[str, ctypes.CDLL] = {}

    def __init__(self, path: str | None = None):
        self.path = path or find_nccl_library()
        lib = self._loaded.get(self.path)
        if lib is None:
            try:
                lib = ctypes.CDLL(self.path)
            except OSError as e:
                raise RuntimeError(f"cannot load NCCL library {self.path}: {e}\nFix: {INSTALL_HINT}") from e
            for table, required in ((_FUNCTIONS, True), (_OPTIONAL, False)):
                for name, (restype, argtypes) in table.items():
                    try:
                        fn = getattr(lib, name)
                    except AttributeError:
                        if required:
                            raise RuntimeError(f"{self.path} is not an NCCL 2 library: no {name}") from None
                        continue
                    fn.restype, fn.argtypes = restype, argtypes
            self._loaded[self.path] = lib
        self.lib = lib
        self.version_code = self._version_code()
        self.version = decode_version(self.version_code)

    def has(self, name: str) -> bool:
        return hasattr(self.lib, name)

    def error_string(self, result: int) -> str:
        return self.lib.ncclGetErrorString(result).decode(errors="replace")

    def _check(self, result: int, call: str, comm=None) -> None:
        if result == NCCL_SUCCESS:
            return
        msg = f"{call} failed: NCCL error {result}: {self.error_string(result)}"
        if comm is not None and self.has("ncclGetLastError"):
            last = self.lib.ncclGetLastError(comm)
            if last:
                msg += f" ({last.decode(errors='replace')})"
        raise RuntimeError(msg)

    def _version_code(self) -> int:
        v = _int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def get_unique_id(self) -> NcclUniqueId:
        uid = NcclUniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return uid

    def comm_init_rank(self, world_size: int, uid: NcclUniqueId, rank: int) -> int:
        """A communicator handle (ncclComm_t as an int); the CUDA device must be
        current. Blocks until every rank has called it."""
        comm = _comm_t()
        self._check(self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank), "ncclCommInitRank")
        return comm.value

    def comm_destroy(self, comm: int) -> None:
        self._check(self.lib.ncclCommDestroy(comm), "ncclCommDestroy")

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int) -> None:
        self._check(self.lib.ncclAllReduce(send, recv, count, dtype, op, comm, stream), "ncclAllReduce", comm)

    def all_gather(self, send: int, recv: int, send_count: int, dtype: int, comm: int, stream: int) -> None:
        self._check(self.lib.ncclAllGather(send, recv, send_count, dtype, comm, stream), "ncclAllGather", comm)

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: int, stream: int) -> None:
        self._check(self.lib.ncclBroadcast(send, recv, count, dtype, root, comm, stream), "ncclBroadcast", comm)

    def reduce_scatter(self, send: int, recv: int, recv_count: int, dtype: int, op: int, comm: int,
                       stream: int) -> None:
        if not self.has("ncclReduceScatter"):
            raise RuntimeError(f"{self.path} has no ncclReduceScatter")
        self._check(self.lib.ncclReduceScatter(send, recv, recv_count, dtype, op, comm, stream),
                    "ncclReduceScatter", comm)


# ---------------------------------------------------------------- communicator
def cuda_device(device) -> torch.device:
    """torch.device('cuda', i) from a device, "cuda:i" or i (no CUDA call
    unless the index is missing and CUDA is there)."""
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"an NCCL communicator needs a CUDA device, got {d}")
    if d.index is None:
        d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return d


def check_device(t, device: torch.device, name: str = "tensor") -> None:
    """t must be a tensor on the communicator's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but the NCCL communicator is on {device}: "
                         f"move it there first (t.to('{device}'))")


def check_tensor(t, device: torch.device, name: str = "tensor") -> None:
    """NCCL reads and writes raw device memory: t must be a contiguous tensor
    on the communicator's device."""
    check_device(t, device, name)
    if not t.is_contiguous():
        raise ValueError(f"{name} (shape {tuple(t.shape)}, stride {t.stride()}) is not contiguous: "
                         "NCCL needs contiguous memory (t.contiguous())")


def _bytes(t: torch.Tensor) -> int:
    """Gather and broadcast do no arithmetic: they move t as ncclUint8 bytes,
    whatever its dtype (bool, fp8 on any NCCL or GPU, ...)."""
    return t.numel() * t.element_size()


def share_unique_id(nccl: NCCLLibrary, group: dist.ProcessGroup) -> NcclUniqueId:
    """Group rank 0's ncclGetUniqueId, broadcast as 128 uint8 over the CPU group."""
    if dist.get_rank(group) == 0:
        uid = torch.frombuffer(bytearray(bytes(nccl.get_unique_id())), dtype=torch.uint8)
    else:
        uid = torch.zeros(NCCL_UNIQUE_ID_BYTES, dtype=torch.uint8)
    dist.broadcast(uid, src=dist.get_global_rank(group, 0), group=group)
    return NcclUniqueId.from_buffer_copy(bytes(uid.tolist()))


class PyNcclCommunicator:
    """An NCCL communicator over the ranks of `group`, a CPU (gloo) process
    group that carries only the 128-byte unique id at construction.

    Collectives are issued on torch.cuda.current_stream(device), never
    synchronise with the host and allocate nothing, so they can be captured
    in a CUDA graph. With one rank no communicator is created and every
    collective is a no-op (all_gather / reduce_scatter copy when out is not
    inp); nccl_at_world_1=True creates a real one-rank communicator instead
    (to exercise NCCL on a single GPU).
    """

    def __init__(self, group: dist.ProcessGroup | None, device, *, library: "NCCLLibrary | str | None" = None,
                 nccl_at_world_1: bool = False):
        group = group if group is not None else dist.group.WORLD
        if dist.get_backend(group) == "nccl":
            raise ValueError("PyNcclCommunicator needs a CPU process group (gloo) to share the NCCL id, "
                             "not an nccl one")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = cuda_device(device)
        self.nccl: NCCLLibrary | None = None
        self.comm: int | None = None
        if self.world_size == 1 and not nccl_at_world_1:
            return
        self.nccl = library if isinstance(library, NCCLLibrary) else NCCLLibrary(library)
        unique_id = share_unique_id(self.nccl, group)
        with torch.cuda.device(self.device):
            self.comm = self.nccl.comm_init_rank(self.world_size, unique_id, self.rank)
            warm = torch.zeros(1, device=self.device)
            self.all_reduce(warm)
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def version(self) -> tuple[int, int, int] | None:
        return self.nccl.version if self.nccl is not None else None

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce t over the ranks, in place; returns t."""
        check_tensor(t, self.device, "all_reduce tensor")
        code, dtype = nccl_op(op), nccl_dtype(t.dtype, self.version)
        if self.comm is not None and t.numel():
            self.nccl.all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), dtype, code, self.comm, self._stream())
        return t

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """Every rank's inp, in rank order, into out (world_size * inp.numel()
        elements, e.g. shape [world_size, *inp.shape]); returns out."""
        check_tensor(inp, self.device, "all_gather input")
        check_tensor(out, self.device, "all_gather output")
        if out.dtype != inp.dtype or out.numel() != inp.numel() * self.world_size:
            raise ValueError(f"all_gather output must hold {self.world_size} x {inp.numel()} {inp.dtype}, "
                             f"got {out.numel()} {out.dtype}")
        if self.comm is None:
            if out.data_ptr() != inp.data_ptr():
                out.view(-1).copy_(inp.view(-1))
        elif inp.numel():
            self.nccl.all_gather(inp.data_ptr(), out.data_ptr(), _bytes(inp), NCCL_UINT8, self.comm, self._stream())
        return out

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce inp over the ranks and keep this rank's 1/world_size slice
        (in rank order) in out; returns out."""
        check_tensor(inp, self.device, "reduce_scatter input")
        check_tensor(out, self.device, "reduce_scatter output")
        if out.dtype != inp.dtype or inp.numel() != out.numel() * self.world_size:
            raise ValueError(f"reduce_scatter input must hold {self.world_size} x {out.numel()} {out.dtype}, "
                             f"got {inp.numel()} {inp.dtype}")
        code, dtype = nccl_op(op), nccl_dtype(inp.dtype, self.version)
        if self.comm is None:
            if out.data_ptr() != inp.data_ptr():
                out.view(-1).copy_(inp.view(-1))
        elif out.numel():
            self.nccl.reduce_scatter(inp.data_ptr(), out.data_ptr(), out.numel(), dtype, code, self.comm,
                                     self._stream())
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's t (src: rank in the group) into every rank's t, in place."""
        check_tensor(t, self.device, "broadcast tensor")
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src {src} is not a rank of this group (size {self.world_size})")
        if self.comm is not None and t.numel():
            self.nccl.broadcast(t.data_ptr(), t.data_ptr(), _bytes(t), NCCL_UINT8, src, self.comm, self._stream())
        return t

    def close(self) -> None:
        """Destroy the NCCL communicator (idempotent)."""
        if self.comm is not None:
            comm, self.comm = self.comm, None
            self.nccl.comm_destroy(comm)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
