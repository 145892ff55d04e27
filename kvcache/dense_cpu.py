"""dense-cpu: compiled CPU decode attention over dense (f32 / bf16 / f16)
paged K/V (kvcache/csrc/dense_cpu_attn.cpp), the default for dense caches on
CPU.

A decode-only step runs one kernel call per layer for the whole batch: the
cache rows are read in place through the block tables (no gathered copy of
K/V, no mask), each K/V row once for the G query heads of its KV head, fp32
accumulation, the output written in q's dtype. Long contexts are split over
threads at fixed key partitions (every dense_cpu_partition() positions)
merged in order, so a sequence's result depends on nothing but its own
inputs: not on the batch, its place in it, or the thread count. The new K/V
rows of a step are stored by the kernel too (store: index_copy_ of k and v in
one call, reading them through their strides; bitwise the same).

Prefill chunks stay on dense-torch's SDPA (GEMM shaped), and in a mixed step
the decode rows go through decode() (the kernel). Everything runs as
dense-torch when the cache is not on the CPU, a dtype is not f32 / bf16 /
f16, or the kernel did not build (logged once, with the compiler's output;
build() raises it); TQSERVE_DENSE_CPU=torch selects dense-torch's attention
(read at each step's first layer and at every decode() call; the store,
index_copy_'s bits, stays). TQSERVE_ATTN_BACKEND=dense-torch runs no
compiled code at all.

The per-call Python is one ctypes call with plain ints: the integers that
are the same for every layer of a group in a step (block tables, lengths)
sit in a small int64 descriptor built once per step (AttentionMetadata.memo),
those of a layer (its K/V stores, strides, window) in one built at the
layer's first call and kept on the cache.
"""
import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

from kvcache.backends import register_backend
from kvcache.dense_cache import DenseTorchBackend
from parallel.cpp_kernel import build_shared_library

log = logging.getLogger("tqserve.engine")

SRC = Path(__file__).resolve().parent / "csrc" / "dense_cpu_attn.cpp"
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}     # the kernel's DT_*
_IDX = {torch.int32: 0, torch.int64: 1}
_ERRORS = {-2: "a sequence longer than its block table", -3: "a block number outside the cache"}


def enabled() -> bool:
    """False when TQSERVE_DENSE_CPU=torch selects dense-torch's path."""
    return os.environ.get("TQSERVE_DENSE_CPU", "kernel").lower() != "torch"


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = build_shared_library(SRC, CXX, FLAGS, "dense CPU attention kernel", "TQSERVE_DENSE_CPU=torch")
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.dense_cpu_partition.restype = i32
    lib.dense_cpu_partition.argtypes = []
    lib.dense_cpu_decode.restype = i32
    lib.dense_cpu_decode.argtypes = [ptr, ptr, ptr, i64, i64, i32, ptr, ctypes.c_float, i32, i32]
    lib.dense_cpu_store.restype = i32
    lib.dense_cpu_store.argtypes = [ptr, ptr, i32, i64, ptr, i64, i64, ptr, i64, i64, i32, i32]
    return lib


def build() -> None:
    """Compile (or load) the kernel now; raises with the compiler's output on failure."""
    _lib()


@lru_cache(maxsize=None)
def _kernel():
    """The loaded library, or None when it does not build (logged once, with why)."""
    try:
        return _lib()
    except RuntimeError as e:
        log.warning("dense-cpu: dense-torch's SDPA (slower) instead of the compiled kernel: %s", e)
        return None


def partition() -> int:
    """Keys per partition: a long context's fixed split over threads."""
    return _lib().dense_cpu_partition()


def _layer(cache):
    """The cache's layer entry, built at first use and rebuilt when its
    stores, their addresses or the window change: (k, v, window, descriptor
    tensor, its address, H, D, decode, store, the stores' addresses); the
    address is None when the kernel cannot read the cache (then dense-torch's
    code runs)."""
    d = cache.__dict__.get("_dense_cpu")
    # (the addresses too: sleep mode gives the same tensors new storage)
    if d is not None and d[0] is cache.k and d[1] is cache.v and d[2] == cache.sliding_window \
            and d[9] == (cache.k.data_ptr(), cache.v.data_ptr()):
        return d
    k, v = cache.k, cache.v
    ok = (k.is_cpu and v.is_cpu and k.dtype in DTYPES and v.dtype == k.dtype and k.dim() == 3
          and v.shape == k.shape and k.stride(2) == 1 and v.stride(2) == 1)
    lib = _kernel() if ok else None
    desc = None if lib is None else torch.tensor(
        [k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1), DTYPES[k.dtype],
         k.shape[1], k.shape[2], cache.block_size, cache.sliding_window or 0, k.shape[0]], dtype=torch.int64)
    cache._dense_cpu = (k, v, cache.sliding_window, desc, None if desc is None else desc.data_ptr(),
                        k.shape[1], k.shape[2], lib and lib.dense_cpu_decode, lib and lib.dense_cpu_store,
                        (k.data_ptr(), v.data_ptr()))
    return cache._dense_cpu


def _step(block_tables, seq_lens):
    """(step descriptor, its address, the tensors it points into) for
    decodes over block_tables [B, W] and seq_lens [B] (CPU int32 / int64,
    no copies); None when the kernel cannot read them."""
    bt, sl = block_tables, seq_lens
    if (not bt.is_cpu or not sl.is_cpu or bt.dtype not in _IDX or sl.dtype not in _IDX or bt.dim() != 2
            or sl.dim() != 1 or bt.shape[0] != sl.shape[0] or bt.stride(1) != 1 or sl.stride(0) != 1):
        return None
    desc = torch.tensor([bt.data_ptr(), bt.stride(0), bt.shape[1], _IDX[bt.dtype], sl.data_ptr(), _IDX[sl.dtype],
                         bt.shape[0]], dtype=torch.int64)
    return desc, desc.data_ptr(), bt, sl


def decode(cache, q, step, scale):
    """q [B, Hq, D] (f32 / bf16 / f16, unit last stride) -> [B, Hq, D] in q's
    dtype, over the cache through step (see _step); None when the kernel
    cannot run it (the caller takes dense-torch's path)."""
    d = _layer(cache)
    qd = DTYPES.get(q.dtype)
    B, Hq, D = q.shape
    sb, sh, sd = q.stride()
    if d[4] is None or qd is None or sd != 1 or D != d[6] or Hq % d[5] or not q.is_cpu:
        return None
    out = torch.empty_like(q) if q.is_contiguous() else torch.empty(B, Hq, D, dtype=q.dtype)
    rc = d[7](d[4], step[1], q.data_ptr(), sb, sh, qd, out.data_ptr(), scale, Hq // d[5], torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"dense CPU attention: {_ERRORS.get(rc, 'bad arguments')} (code {rc})")
    return out


def store(cache, slot_mapping, k, v) -> bool:
    """cache.k / cache.v [slot_mapping] = k, v (converted to the cache's
    dtype), as index_copy_, in one kernel call; False (nothing written) when
    the kernel cannot: the caller runs index_copy_."""
    d = _layer(cache)
    kd, si = DTYPES.get(k.dtype), _IDX.get(slot_mapping.dtype)
    ks, vs, shape = k.stride(), v.stride(), k.shape
    if (d[4] is None or kd is None or si is None or v.dtype != k.dtype or len(ks) != 3 or ks[2] != 1 or vs[2] != 1
            or v.shape != shape or shape[1] != d[5] or shape[2] != d[6] or slot_mapping.numel() != shape[0]
            or not slot_mapping.is_contiguous() or not (k.is_cpu and v.is_cpu and slot_mapping.is_cpu)):
        return False
    return d[8](d[4], slot_mapping.data_ptr(), si, shape[0], k.data_ptr(), ks[0], ks[1], v.data_ptr(), vs[0], vs[1],
                kd, torch.get_num_threads()) == 0


@register_backend("dense-cpu", "dense")
class DenseCpuBackend(DenseTorchBackend):
    """dense-torch with its decodes (and stores) in the compiled kernel; see
    the module docstring for when it runs dense-torch's code instead."""

    def forward(self, cache, q, meta, scale):
        if meta.num_decodes != meta.num_seqs:
            return super().forward(cache, q, meta, scale)     # its decodes come to decode() below
        key = ("dense-cpu", cache.group_id)
        step = meta.memo.get(key, False)
        if step is False:
            step = meta.memo[key] = (_step(meta.groups[cache.group_id].block_tables, meta.seq_lens_t)
                                     if enabled() else None)
        out = None if step is None else decode(cache, q, step, scale)
        return super().forward(cache, q, meta, scale) if out is None else out

    def decode(self, cache, q, block_tables, seq_lens, scale):
        step = _step(block_tables, seq_lens) if enabled() else None
        out = None if step is None else decode(cache, q, step, scale)
        return super().decode(cache, q, block_tables, seq_lens, scale) if out is None else out

    store = staticmethod(store)     # DenseLayerCache.write calls it (False: index_copy_)
