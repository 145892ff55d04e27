"""dense-cpu: decodes over dense (f32 / bf16 / f16) paged K/V through the
compiled CPU attention kernel (kvcache/csrc/tq_cpu_attn.cpp, whose f16 / bf16
/ f32 component kinds read a dense cache's rows as they are): one call per
layer for the whole decode batch, one online softmax per KV head shared by
its query heads, no gathered copy of K/V, no mask. The integer inputs (block
tables, columns, positions) are the same for every layer of a group in a
step and are built once (AttentionMetadata.memo).

Prefill chunks stay on dense-torch's SDPA (flash attention on CPU: GEMM
shaped, which the kernel's row tiles are not), as does everything when the
kernel is off (TQSERVE_TQ_CPU=torch) or has no build for the head_dim. The
default for dense caches on CPU."""
import ctypes

import torch

from kvcache import tq_cpu
from kvcache.backends import register_backend
from kvcache.dense_cache import DenseTorchBackend

_KIND = {torch.float16: 0, torch.bfloat16: 3, torch.float32: 4}


def _comp(x: torch.Tensor) -> "tq_cpu._Comp":
    """A [slots, H, D] store as the kernel's component."""
    return tq_cpu._Comp(_KIND[x.dtype], 0, x.shape[-1], 0, x.data_ptr(), x.stride(0), x.stride(1), 0, 0, 0, None)


@register_backend("dense-cpu", "dense")
class DenseCpuBackend(DenseTorchBackend):
    def forward(self, cache, q, meta, scale):
        if meta.num_decodes != meta.num_seqs or not self._runs(cache):
            return super().forward(cache, q, meta, scale)     # its decodes come to decode() below
        key = ("dense-cpu-decode", cache.group_id, cache.sliding_window)
        index = meta.memo.get(key)
        if index is None:
            index = meta.memo[key] = self._index(cache, meta.groups[cache.group_id].block_tables, meta.seq_lens_t)
        return self._attend_kernel(cache, q, index, scale)

    def decode(self, cache, q, block_tables, seq_lens, scale):
        if not self._runs(cache):
            return super().decode(cache, q, block_tables, seq_lens, scale)
        return self._attend_kernel(cache, q, self._index(cache, block_tables, seq_lens), scale)

    @staticmethod
    def _runs(cache) -> bool:
        return cache.k.device.type == "cpu" and cache.k.dtype in _KIND and tq_cpu.enabled(cache.head_dim)

    @staticmethod
    def _index(cache, block_tables, seq_lens):
        """(block tables, columns read, query positions, lengths), int64 and contiguous."""
        lens = seq_lens.to(torch.int64).contiguous()
        cols = cache.decode_columns(block_tables, lens).to(torch.int64).contiguous()
        return block_tables.to(torch.int64).contiguous(), cols, (lens - 1)[:, None].contiguous(), lens

    @staticmethod
    def _attend_kernel(cache, q, index, scale):
        tables, cols, qpos, lens = index
        B, Hq, D = q.shape
        H = cache.num_kv_heads
        qs = (q.to(torch.float32) * scale).contiguous()          # [B, H, G, 1, D] as the kernel reads it
        out = torch.empty_like(qs)
        lse = torch.empty(B, Hq, dtype=torch.float32)
        k, v = _comp(cache.k), _comp(cache.v)
        passes = (tq_cpu._Pass * 1)(tq_cpu._Pass(ctypes.pointer(k), ctypes.pointer(v), tables.data_ptr(),
                                                  tables.data_ptr(), tables.shape[1], cols.data_ptr(),
                                                  cols.shape[1], 0, 0))
        rc = tq_cpu._lib().tq_cpu_attend(passes, 1, qs.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, Hq // H, 1,
                                         D, cache.block_size, qpos.data_ptr(), lens.data_ptr(),
                                         cache.sliding_window or 0, 0, torch.get_num_threads(), tq_cpu.ROW_TILE)
        if rc != 0:
            raise ValueError(f"CPU attention kernel: unsupported head_dim {D}")
        return out.to(q.dtype)
