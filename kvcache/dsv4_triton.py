"""Launchers of DeepSeek-V4's Triton kernels (kvcache/dsv4_triton_kernels.py):
the entries part of a batched step's attention and the lightning indexer's
scores (the dsv4-triton backend of kvcache/dsv4_attn.py). No host sync, no
host value of a length: grids come from tensor shapes (the table width,
top-k), the loops end at each sequence's count read on the device, so a CUDA
graph captures them at the table's bound and a replay reads only what each
sequence uses."""
import torch

from kvcache.dense_triton import decode_splits
from kvcache.tq_triton import _component, _next_pow2

DENSE = 3     # entry_attn_kernel's KIND for entries stored dense


def entry_tiles(D: int, coded: bool):
    """(query heads per program, entries per tile, warps, pipeline stages):
    no register spills for sm_90 / sm_121 at 16-bit queries, with Triton 3.9
    and 3.6 (the H200 machine's), but for 512-dim coded tiles, which spill
    8-32 bytes with 3.6 in every shape tried (tests/test_dsv4_triton.py
    compiles them); not tuned on a GPU."""
    if not coded:
        return 16, 32, (4 if D <= 128 else 8), 2
    return (16, 32, 8, 2) if D <= 64 else (16, 16, 8, 2) if D <= 256 else (16, 16, 8, 1)


def entry_attention(q: torch.Tensor, store, sel: torch.Tensor, count: torch.Tensor | None, scale: float,
                    num_splits: int | None = None):
    """q [B, H, D] (unrotated) over the entries sel [B, K] of store (a
    DSV4LayerStorage; t used iff t < count[b], or every t when count is None,
    and sel[b, t] >= 0) -> (o [S, B, H, D] fp32, lse [S, B, H] fp32) per split
    of the entries; o is in the codec's rotated domain when store.codec."""
    B, H, D = q.shape
    K = sel.shape[1]
    assert D == _next_pow2(D) and q.stride(2) == 1 and sel.stride(1) == 1
    dev = q.device
    codec = store.codec
    bh, bn, warps, stages = entry_tiles(D, codec is not None)
    hb = -(-H // bh)
    if codec is None:
        data = store.entries["comp"]
        sc, cb, st, (kind, bits, group) = data, data, (data.stride(0), 0, 0, 0), (DENSE, 16, D)
    else:
        data, sc, cb, st, (kind, bits, group) = _component(codec, store.coded, dev)
        q = (q.float() @ codec.rot_t(dev)).to(q.dtype)
    splits = num_splits or decode_splits(B, hb, K, bn, dev)
    per_split = -(-max(K, 1) // splits)
    per_split = -(-per_split // bn) * bn
    o = torch.empty(splits, B, H, D, dtype=torch.float32, device=dev)
    lse = torch.empty(splits, B, H, dtype=torch.float32, device=dev)
    if B == 0:
        return o, lse
    from kvcache.dsv4_triton_kernels import entry_attn_kernel
    entry_attn_kernel[(B, hb, splits)](
        q, sel, sel if count is None else count, data, sc, cb, o, lse,
        q.stride(0), q.stride(1), sel.stride(0), *o.stride()[:3], *lse.stride()[:2], *st,
        H, K, per_split, scale,
        KIND=kind, BITS=bits, GROUP=group, D=D, BH=bh, BN=bn, ALL=count is None,
        F32=q.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return o, lse


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                 count: torch.Tensor, block_e: int = 64) -> torch.Tensor:
    """The lightning indexer: q [B, h, d], w [B, h] fp32 head weights, indexer
    keys [N, d] at rows [B, E] -> [B, E] fp32 scores, -inf at t >= count[b]."""
    B, h, d = q.shape
    E = rows.shape[1]
    assert d == _next_pow2(d) and keys.stride(1) == 1 and rows.stride(1) == 1
    # The reference scores in fp32 from 16-bit inputs: products are exact in
    # the keys' 16-bit type (a bf16 query is exact in fp16 but for range).
    q = q.to(keys.dtype).contiguous()
    w = w.float().contiguous()
    out = torch.empty(B, E, dtype=torch.float32, device=q.device)
    if B == 0 or E == 0:
        return out
    from kvcache.dsv4_triton_kernels import index_scores_kernel
    index_scores_kernel[(B, -(-E // block_e))](
        q, w, keys, rows, count, out, q.stride(0), q.stride(1), w.stride(0), keys.stride(0), rows.stride(0),
        out.stride(0), h, E, d ** -0.5,
        HP=max(16, _next_pow2(h)), DI=d, BE=block_e, F32=keys.dtype == torch.float32,
        num_warps=4)
    return out


def pool_tiles(span: int):
    """(channels per program, warps) for a window of span rows: no spills for
    sm_90 / sm_121 (tests/test_dsv4_triton.py)."""
    return (64, 4) if span <= 16 else (32, 8)


def pool_rows(kv_ring: torch.Tensor, gate_ring: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
              kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """dsv4_attn.DSV4Backend.pool_rows in one launch: [B, d] in kv's dtype."""
    B, width = kv.shape
    d = width // 2 if overlap else width
    span = (2 if overlap else 1) * ratio
    assert span == _next_pow2(span) and kv_ring.stride(2) == 1 and gate_ring.stride(2) == 1
    kv, gate = kv.contiguous(), gate.contiguous()
    out = torch.empty(B, d, dtype=torch.float32, device=kv.device)
    block_d, warps = pool_tiles(span)
    if B:
        from kvcache.dsv4_triton_kernels import pool_rows_kernel
        pool_rows_kernel[(B, -(-d // block_d))](
            kv_ring, gate_ring, slots, pos, kv, gate, bias, out, kv_ring.stride(0), kv_ring.stride(1),
            gate_ring.stride(0), gate_ring.stride(1), kv.stride(0), gate.stride(0), bias.stride(0), out.stride(0),
            kv_ring.shape[0], kv_ring.shape[1], d, RATIO=ratio, SPAN=span, OVERLAP=overlap, BD=block_d,
            num_warps=warps)
    return out.to(kv.dtype)
