"""Compiled CPU attention over TurboQuant paged blocks (kvcache/csrc/tq_cpu_attn.cpp).

The tq-cpu attention backend (TQCpuBackend below, the default for TurboQuant
caches on CPU) runs it; TQLayerCache._attend_torch stays the reference it is
tested against (tests/test_tq_cpu.py). The kernel decodes one
block of keys and values at a time straight from the packed codes, shared by
every query row of a KV head, with an online softmax: the torch path's
per-chunk op overhead and float intermediates dominate decode on CPU.

The source is a plain C ABI called through ctypes, so building needs only a
C++ compiler with OpenMP (g++), no torch headers or ninja. It is compiled at
first use into $TQSERVE_KERNEL_CACHE (default ~/.cache/tqserve/kernels),
keyed by the source, flags and host CPU. A failed build raises with the
compiler's output; TQSERVE_TQ_CPU=torch selects the torch path instead.
"""
import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch

from kvcache.backends import register_backend
from kvcache.tq_cache import TQTorchBackend
from parallel.cpp_kernel import build_shared_library

SRC = Path(__file__).resolve().parent / "csrc" / "tq_cpu_attn.cpp"
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ROW_TILE = 16        # query tokens per work item in prefill (times G query heads)
_KIND = {"f16": 0, "int8": 1, "tq": 2}


class _Comp(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("bits", ctypes.c_int32), ("group", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("data", ctypes.c_void_p), ("d_slot", ctypes.c_int64),
                ("d_head", ctypes.c_int64), ("scale", ctypes.c_void_p), ("s_slot", ctypes.c_int64),
                ("s_head", ctypes.c_int64), ("codebook", ctypes.c_void_p)]


class _Pass(ctypes.Structure):
    _fields_ = [("k", ctypes.POINTER(_Comp)), ("v", ctypes.POINTER(_Comp)), ("k_tables", ctypes.c_void_p),
                ("v_tables", ctypes.c_void_p), ("width", ctypes.c_int64), ("cols", ctypes.c_void_p),
                ("ncols", ctypes.c_int64), ("part", ctypes.c_int32), ("pad", ctypes.c_int32)]


HEAD_DIMS = (8, 16, 32, 64, 128, 256, 512)   # the kernel's compiled specialisations


def enabled(head_dim: int) -> bool:
    """Whether tq-cpu runs the compiled kernel (the default; read at every call)."""
    return os.environ.get("TQSERVE_TQ_CPU", "kernel").lower() != "torch" and head_dim in HEAD_DIMS


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = build_shared_library(SRC, CXX, FLAGS, "TurboQuant CPU attention kernel", "TQSERVE_TQ_CPU=torch")
    lib.tq_cpu_attend.restype = ctypes.c_int
    lib.tq_cpu_attend.argtypes = ([ctypes.POINTER(_Pass), ctypes.c_int] + [ctypes.c_void_p] * 3
                                  + [ctypes.c_int] * 6 + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                                  + [ctypes.c_int] * 3)
    return lib


def build() -> None:
    """Compile (or load) the kernel now; raises with the compiler's output on failure."""
    _lib()


_CB: dict = {}


def _comp(codec, store) -> _Comp:
    kind = codec.fmt.kind
    data = store["x"] if kind == "f16" else store["q"] if kind == "int8" else store["codes"]
    c = _Comp(_KIND[kind], codec.fmt.bits, codec.group if kind == "tq" else codec.D, 0,
              data.data_ptr(), data.stride(0), data.stride(1), 0, 0, 0, None)
    if kind != "f16":
        sc = store["scale"]
        assert sc.dtype == torch.float16
        c.scale, c.s_slot, c.s_head = sc.data_ptr(), sc.stride(0), sc.stride(1)
    if kind == "tq":
        key = id(codec.codebook)
        if key not in _CB:     # codebooks are lru_cached per (bits, group): one float32 copy each
            _CB[key] = (codec.codebook, codec.codebook.float().contiguous())
        c.codebook = _CB[key][1].data_ptr()
    return c


def attend(cache, qr, cols, block_tables, qpos, seq_lens, part=0, v_tables=None, klim=None):
    """Same contract as TQLayerCache._attend_torch: qr [B, H, G, Lq, D] rotated,
    scaled queries -> (rotated output [B, H, G, Lq, D] in qr's dtype, log-sum-exp
    [B, H, G, Lq] float32), over the keys `part` selects, from the stores
    cache.part_stores(part); values through v_tables (None: block_tables);
    klim [B, Lq]: each query's last key (None: its position), in the kernel."""
    return attend_passes(cache, qr, [(part, cols, block_tables, v_tables)], qpos, seq_lens, klim)


def attend_passes(cache, qr, passes, qpos, seq_lens, klim=None):
    """Attention over the union of disjoint passes' keys in one kernel call
    (one online softmax): passes = [(part, cols, block_tables, v_tables)],
    each as in attend. A hot-token decode's CODED and HOT passes run as one
    call, with no merge in torch."""
    B, H, G, Lq, D = qr.shape
    q = qr.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(B, H, G, Lq, dtype=torch.float32)
    keep, arr = [], (_Pass * len(passes))()       # keep: tensors and structs the call points into
    for i, (part, cols, block_tables, v_tables) in enumerate(passes):
        bt = block_tables.to(torch.int64).contiguous()
        vt = bt if v_tables is None else v_tables.to(torch.int64).contiguous()
        if vt.shape != bt.shape:
            raise ValueError(f"v_tables {tuple(vt.shape)} must match block_tables {tuple(bt.shape)}")
        cols = cols.to(torch.int64).contiguous()
        kc, ks, vc, vs = cache.part_stores(part)
        k, v = _comp(kc, ks), _comp(vc, vs)
        keep += [bt, vt, cols, k, v]
        arr[i] = _Pass(ctypes.pointer(k), ctypes.pointer(v), bt.data_ptr(), vt.data_ptr(), bt.shape[1],
                       cols.data_ptr(), cols.shape[1], int(part), 0)
    qpos = qpos.to(torch.int64).expand(B, Lq).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    if klim is not None:
        klim = klim.to(torch.int64).expand(B, Lq).contiguous()
    rc = _lib().tq_cpu_attend(arr, len(passes), q.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, G, Lq, D,
                              cache.block_size, qpos.data_ptr(), None if klim is None else klim.data_ptr(),
                              seq_lens.data_ptr(), cache.sliding_window or 0,
                              cache.sink, torch.get_num_threads(), ROW_TILE)
    if rc != 0:
        raise ValueError(f"TurboQuant CPU kernel: unsupported head_dim {D}, parts "
                         f"{[p[0] for p in passes]} or sink {cache.sink}")
    return out.to(qr.dtype), lse


@register_backend("tq-cpu", "tq")
class TQCpuBackend(TQTorchBackend):
    """tq-torch's decode / prefill with their passes in the compiled kernel
    (this module's attend / attend_passes), or in torch where enabled() says
    no: TQSERVE_TQ_CPU=torch, or a head_dim the kernel has no build for.
    Key limits (bidirectional spans) go into the kernel (klim); a hot
    cache's HOT prefill pass is tq-torch's (_hot_prefill) either way."""

    def attend(self, cache, qr, cols, block_tables, qpos, seq_lens, part=0, v_tables=None, klim=None):
        if enabled(cache.head_dim):
            return attend(cache, qr, cols, block_tables, qpos, seq_lens, part, v_tables, klim)   # the module's
        return super().attend(cache, qr, cols, block_tables, qpos, seq_lens, part, v_tables, klim)

    def attend_passes(self, cache, qr, passes, qpos, seq_lens, klim=None):
        if enabled(cache.head_dim):
            return attend_passes(cache, qr, passes, qpos, seq_lens, klim)
        return super().attend_passes(cache, qr, passes, qpos, seq_lens, klim)
