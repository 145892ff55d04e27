"""A step's new K/V into a TurboQuant layer cache (TQLayerCache) in one Triton
launch: tq_store(cache, slot_mapping, k, v, hot_slots) stores exactly what
TQLayerCache.write(slot_mapping, k, v, hot_slots) stores, and with
new_rows=True returns of write's return value what a HOT prefill launch
reads (the hot K rows, and the hot V rows with hot "kv"), tested against it
with Triton's interpreter (tests/test_tq_store.py).

The torch write encodes with ~85 small ops per layer and step
(Codec.quantize_rotated, pack_bits, one index_copy_ per stored tensor) and,
with hot tokens, reads a flag back from the device (bool(keep.all())). Here
the rotation stays in torch, the same ops as the torch write (keys less the
key mean when set, one matmul each for K and V: the kernel sees the same
fp32 rotated rows), and one kernel (tq_store_kernels.tq_store_kernel, a
program per token and KV head) quantizes K and V in their formats (f16,
int8, TurboQuant 2-5 bits with norm groups of head_dim or 32 / 64), packs
the codes and writes their rows, and with hot_slots the int8 hot copies
(K; and V with hot="kv"), in the same launch. A negative slot, in
slot_mapping or hot_slots, writes nothing, decided on the device: nothing
is read back, no tensor is built from Python data and the codebooks go to
the device once (cached here), so a decode step that stores this way can be
captured in a CUDA graph (padded rows carry slot -1).

triton is imported on the first call, never by importing this.
"""
import torch

_KIND = {"f16": 0, "int8": 1, "tq": 2}
_HOT = {"k": 1, "kv": 2}
_TABLES: dict = {}      # (bits, group, device) -> fp32 [2**bits centroids, 2**bits - 1 bounds]


def _table(codec, device) -> torch.Tensor:
    key = (codec.fmt.bits, codec.group, str(device))
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = torch.cat([codec.codebook, codec.bounds]).to(device=device,
                                                                       dtype=torch.float32).contiguous()
    return t


def _component(codec, store: dict, device):
    """(data, scale, table, data strides, scale strides, (kind, bits, group)) for one component."""
    kind = codec.fmt.kind
    data = store["x"] if kind == "f16" else store["q"] if kind == "int8" else store["codes"]
    scale = store.get("scale")
    sc_st = (0, 0) if scale is None else (scale.stride(0), scale.stride(1))
    assert data.stride(-1) == 1 and (scale is None or scale.stride(-1) == 1)
    if kind == "tq":
        table, bits, group = _table(codec, device), codec.fmt.bits, codec.group
    else:
        table, bits, group = data, codec.fmt.bits, codec.D     # table unused
    return (data, data if scale is None else scale, table, (data.stride(0), data.stride(1)), sc_st,
            (_KIND[kind], bits, group))


def _num_warps(D: int) -> int:
    return max(1, min(4, D // 128))


def _int8_rows(like: torch.Tensor, T: int) -> dict:
    H, D = like.shape[1:]
    return {"q": like.new_empty(T, H, D, dtype=torch.int8), "scale": like.new_empty(T, H, 1, dtype=torch.float16)}


def tq_store(cache, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             hot_slots: torch.Tensor | None = None, new_rows: bool = False):
    """k, v: [T, Hkv, D] (any float dtype) into `cache` (a TQLayerCache) at
    rows slot_mapping [T] (integer, on k's device), and with hot_slots [T]
    also the hot int8 copies; negative slots are skipped. One launch, no
    host sync. new_rows (with hot_slots): also return every new token's
    int8 hot rows in batch order, (K rows, V rows with hot "kv" else None),
    each {"q": [T, H, D] int8, "scale": [T, H, 1] fp16} as
    TQLayerCache.write returns them: a HOT prefill pass over a chunk longer
    than the hot group holds reads its new keys (and values) there."""
    from kvcache.tq_store_kernels import tq_store_kernel    # imports triton
    T, H, D = k.shape
    assert not new_rows or hot_slots is not None, "new rows are the hot copies' rows"
    rows = None
    if new_rows:     # written whole by the kernel: no fill
        rows = (_int8_rows(k, T), _int8_rows(k, T) if cache.hot == "kv" else None)
    if T == 0:
        return rows
    assert (H, D) == (cache.num_kv_heads, cache.head_dim) and v.shape == k.shape
    if hot_slots is not None and not cache.hot:
        raise ValueError("hot_slots given for a cache without hot tokens")
    dev = k.device
    # TQLayerCache.write's rotation, op for op (the same fp32 rows).
    if cache.k_mean is not None:
        k = k.float() - cache.k_mean
    rot = cache.kc.rot_t(dev)
    yk, yv = k.float() @ rot, v.float() @ rot
    assert yk.stride(-1) == 1 and yv.stride(-1) == 1
    kd, ks, kt, kd_st, ks_st, (kk, kb, kg) = _component(cache.kc, cache.k, dev)
    vd, vs, vt, vd_st, vs_st, (vk, vb, vg) = _component(cache.vc, cache.v, dev)
    hot = 0 if hot_slots is None else _HOT[cache.hot]
    if hot:
        hkd, hks = cache.hk["q"], cache.hk["scale"]
        hvd, hvs = (cache.hv["q"], cache.hv["scale"]) if hot == 2 else (hkd, hks)
    else:
        hkd = hks = hvd = hvs = kd      # unused
    if rows is not None:
        nk = rows[0]
        nv = rows[1] or nk
        nst = (nk["q"].stride(0), nk["q"].stride(1), nk["scale"].stride(0), nk["scale"].stride(1))
    else:
        nk = nv = {"q": kd, "scale": kd}    # unused
        nst = (0, 0, 0, 0)
    tq_store_kernel[(T, H)](
        yk, yv, slot_mapping, slot_mapping if hot_slots is None else hot_slots,
        yk.stride(0), yk.stride(1), yv.stride(0), yv.stride(1),
        kd, ks, kt, *kd_st, *ks_st,
        vd, vs, vt, *vd_st, *vs_st,
        hkd, hks, hkd.stride(0), hkd.stride(1), hks.stride(0), hks.stride(1),
        hvd, hvs, hvd.stride(0), hvd.stride(1), hvs.stride(0), hvs.stride(1),
        nk["q"], nk["scale"], nv["q"], nv["scale"], *nst,
        D=D, K_KIND=kk, K_BITS=kb, K_GROUP=kg, V_KIND=vk, V_BITS=vb, V_GROUP=vg, HOT=hot,
        NEW_ROWS=0 if rows is None else hot, num_warps=_num_warps(D))
    return rows
