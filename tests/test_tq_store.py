"""The fused TurboQuant cache write (kvcache.tq_store: one Triton launch for
K, V and the hot int8 copies) against TQLayerCache.write on the same inputs,
run on CPU by Triton's interpreter: every component format (tq2-5, norm
groups 32 / 64, int8, f16) for K and for V, mixed K/V formats, head_dim
64 / 128 / 256, one and several KV heads, fp32 / bf16 / fp16 inputs, a key
mean, hot "k" / "kv" with tokens without a hot block, padded rows (slot -1:
nothing written), slots out of order, a zero vector, exact ties (int8
round-half-even, a TurboQuant coordinate on a bound); and a compile check
for sm_90 / sm_121 (no GPU needed): no register spills."""
import os

os.environ["TRITON_INTERPRET"] = "1"     # before triton is first imported: CPU tensors


import pytest
import torch

from kvcache import tq_store as tq_store_mod
from kvcache.kv_formats import component
from kvcache.tq_cache import TQLayerCache
from kvcache.tq_store import tq_store
from kvcache.turboquant import unpack_bits
from triton_compile import assert_fit, spec

BS, NBLK, HOT_BLK = 16, 4, 2


def _caches(kf, vf, H, D, hot, seed=0):
    """Two identical caches (reference, kernel) whose every store tensor is
    pre-filled with the same random sentinel bytes, and a copy of those."""
    g = torch.Generator().manual_seed(seed)
    a, b = (TQLayerCache(NBLK, BS, H, D, kf, vf, 0, seed=5, hot=hot, hot_blocks=HOT_BLK, hot_group_id=1)
            for _ in range(2))
    before = {}
    for part in ("k", "v", "hk", "hv"):
        for name, t in getattr(a, part).items():
            if t.dtype == torch.float16:
                t.copy_(torch.randn(t.shape, generator=g) * 3)
            else:
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
            getattr(b, part)[name].copy_(t)
            before[part, name] = t.clone()
    return a, b, before


def _check_stores(a, b, before, part, codec, written):
    """Rows `written` of store `part`: int8 / f16 rows and int8 scales bitwise
    equal; TurboQuant codes equal for >= 99.9% of coordinates (the kernel
    sums a norm in another fp32 order than torch: a coordinate sitting on a
    bound within an ulp can take the neighbouring code) and, on the (slot,
    head) rows whose codes all match, scales within one fp16 ulp. Every
    other row as it was."""
    sa, sb = getattr(a, part), getattr(b, part)
    n = sa[next(iter(sa))].shape[0]
    rest = torch.ones(n, dtype=torch.bool)
    rest[written] = False
    for name in sa:
        assert torch.equal(sb[name][rest], before[part, name][rest]), (part, name, "row outside the slots changed")
    ok = None
    if codec.fmt.kind != "tq":
        for name in sa:
            assert torch.equal(sb[name][written], sa[name][written]), (part, name)
        return ok
    bits = codec.fmt.bits
    ca, cb = (unpack_bits(s["codes"][written], bits, codec.D) for s in (sa, sb))
    same = ca == cb
    assert same.float().mean() >= 0.999, (part, float(same.float().mean()))
    ok = same.all(-1)                                   # [n, H]
    torch.testing.assert_close(sb["scale"][written][ok].float(), sa["scale"][written][ok].float(),
                               rtol=2 ** -10, atol=0)
    return ok


def _close_rows(x, ref, ok, rel=2e-3):
    """[n, H, D]: rows with ok (None: all) within rel of the row's largest |value|."""
    if ok is not None:
        x, ref = x[ok], ref[ok]
    err = (x - ref).abs().amax(-1)
    assert (err <= rel * ref.abs().amax(-1) + 1e-6).all(), float(err.max())


# (K, V, KV heads, head_dim, input dtype, hot, key mean)
CASES = [
    ("tq4", "tq4", 2, 64, torch.float32, "", False),
    ("tq3", "tq3", 1, 128, torch.bfloat16, "k", True),
    ("tq2", "tq2", 3, 64, torch.float32, "kv", False),
    ("tq5", "tq5", 2, 128, torch.float32, "", True),
    ("tq4g32", "tq4g32", 2, 128, torch.bfloat16, "kv", True),
    ("tq3g64", "tq3g64", 2, 128, torch.float32, "k", False),
    ("q8", "q8", 2, 64, torch.float16, "kv", False),                # k8v8
    ("q8", "tq4", 4, 128, torch.float32, "k", True),                # k8v4
    ("tq4", "tq2", 2, 64, torch.bfloat16, "kv", False),             # k4v2
    ("f16", "tq3", 2, 128, torch.float32, "k", False),              # k16v3
    ("tq4", "f16", 1, 64, torch.bfloat16, "", True),                # k4v16
    ("tq5g32", "tq3", 1, 256, torch.float32, "kv", True),
]


@pytest.mark.parametrize("kn,vn,H,D,dtype,hot,mean", CASES,
                         ids=[f"k{c[0]}-v{c[1]}-h{c[2]}-d{c[3]}-{str(c[4])[6:]}-hot{c[5] or 0}"
                              + ("-mean" if c[6] else "") for c in CASES])
def test_matches_torch_write(kn, vn, H, D, dtype, hot, mean):
    kf, vf = component(kn), component(vn)
    a, b, before = _caches(kf, vf, H, D, hot)
    g = torch.Generator().manual_seed(1)
    T = 7
    k = (torch.randn(T, H, D, generator=g) * 2 + 0.5).to(dtype)
    v = torch.randn(T, H, D, generator=g).to(dtype)
    v[3] = 0                                            # a zero vector: norm 0, int8 scale 0
    if not mean:
        k[4] = 0
    if mean:
        mu = torch.randn(H, D, generator=g) * 0.5 + 0.5
        a.set_key_mean(mu)
        b.set_key_mean(mu)
    slots = torch.randperm(NBLK * BS, generator=g)[:T]  # out of order
    slots[[2, 5]] = -1                                  # padded rows: nothing written
    valid = slots >= 0
    hot_slots = None
    if hot:
        hot_slots = torch.randperm(HOT_BLK * BS, generator=g)[:T]
        hot_slots[1] = -1                               # a token without a hot block
        hot_slots[~valid] = -1
    # The torch write cannot take negative slots (index_copy_): it gets the
    # valid rows only.
    ref_rows = a.write(slots[valid], k[valid], v[valid], None if hot_slots is None else hot_slots[valid])
    rows = tq_store(b, slots, k, v, hot_slots, new_rows=bool(hot))
    if hot:
        # The new tokens' int8 hot rows (what a long chunk's HOT pass reads), in
        # batch order, as the torch write returns them: K, and V with "kv".
        assert rows[1] is None if hot == "k" else rows[1] is not None
        for got, ref in zip(rows, ref_rows if hot == "kv" else ref_rows[:1]):
            for name in ("q", "scale"):
                assert torch.equal(got[name][valid], ref[name]), name

    written = slots[valid]
    ok_k = _check_stores(a, b, before, "k", a.kc, written)
    ok_v = _check_stores(a, b, before, "v", a.vc, written)
    ka, va = a.dequantized(written)
    kb, vb = b.dequantized(written)
    _close_rows(kb, ka, ok_k)
    _close_rows(vb, va, ok_v)
    if hot:
        hw = hot_slots[hot_slots >= 0]
        _check_stores(a, b, before, "hk", a.hkc, hw)
        if hot == "kv":
            _check_stores(a, b, before, "hv", a.hvc, hw)
    # The device tables are built once per (bits, group, device) and reused.
    for c in (a.kc, a.vc):
        if c.fmt.kind == "tq":
            assert tq_store_mod._table(c, "cpu") is tq_store_mod._table(b.kc if c is a.kc else b.vc, "cpu")


def test_exact_ties(monkeypatch):
    # head_dim 64: the rotation's entries are +-1/8, so small integer rotated
    # rows survive x = y R (unrotate) and x R^T (the write's matmul) exactly,
    # and the rows below reach the kernel as written.
    H, D = 1, 64
    a, b, before = _caches(component("tq2"), component("q8"), H, D, "kv")
    # K: a made-up 2-bit codebook whose bounds are exactly u = 3/5, -4/5 and 0
    # (y = (3, -4, 0, ...) has norm 5): a coordinate on a bound takes the
    # lower code (torch.bucketize, right=False: the bounds strictly below).
    u3, u4 = torch.tensor(3.0) / 5, torch.tensor(-4.0) / 5
    bounds = torch.stack([u4, torch.tensor(0.0), u3])
    book = torch.tensor([-1.0, -0.25, 0.25, 1.0])
    for c in (a.kc, b.kc):
        monkeypatch.setattr(c, "bounds", bounds)
        monkeypatch.setattr(c, "codebook", book)
    monkeypatch.setattr(tq_store_mod, "_TABLES", {})
    yk = torch.zeros(2, H, D)
    yk[0, 0, :2] = torch.tensor([3.0, -4.0])
    yk[1, 0, :4] = torch.tensor([4.0, 3.0, -3.0, 5.0])     # norm sqrt(59): no tie
    # V (int8, and both hot copies): max 254 -> scale exactly 2, so y / s
    # has halves: 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5 round half to even.
    yv = torch.zeros(2, H, D)
    yv[0, 0, :8] = torch.tensor([254.0, 1, 3, 5, -1, -3, -5, 7])
    yv[1, 0, :3] = torch.tensor([-127.0, 63, 64])            # scale 1: no halves
    rot = a.kc.rot_t("cpu")
    k, v = yk @ rot.T, yv @ rot.T
    assert torch.equal(k @ rot, yk) and torch.equal(v @ rot, yv)
    slots, hot_slots = torch.tensor([9, 2]), torch.tensor([5, 0])
    a.write(slots, k, v, hot_slots)
    tq_store(b, slots, k, v, hot_slots)
    for part in ("k", "v", "hk", "hv"):
        for name, t in getattr(a, part).items():
            assert torch.equal(getattr(b, part)[name], t), (part, name)
    codes = unpack_bits(b.k["codes"][9], 2, D)[0]
    assert codes[:3].tolist() == [2, 0, 1] and (codes[2:] == 1).all()
    assert b.v["q"][9, 0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 4]
    assert b.v["scale"][9, 0, 0].item() == 2.0 and b.hv["scale"][5, 0, 0].item() == 2.0
    assert torch.equal(b.hv["q"][5], b.v["q"][9])


def test_empty_batch_writes_nothing():
    a, b, before = _caches(component("tq4"), component("tq3"), 2, 64, "k")
    rows = tq_store(b, torch.zeros(0, dtype=torch.long), torch.zeros(0, 2, 64), torch.zeros(0, 2, 64),
                    torch.zeros(0, dtype=torch.long), new_rows=True)
    assert rows[0]["q"].shape == (0, 2, 64) and rows[1] is None
    for (part, name), t in before.items():
        assert torch.equal(getattr(b, part)[name], t)


_STORE = {0: "fp16", 1: "i8", 2: "u8"}


# D, K kind/bits/group, V kind/bits/group, hot, slot dtype (kinds: 0 f16, 1 int8, 2 tq). The
# kernel always reads fp32 rotated rows, whatever the model's dtype (bf16 / fp32 inputs are
# rotated in torch first), so the input dtype is not a kernel parameter.
_CASES = [(128, 2, 4, 128, 2, 3, 128, 2, "i64"),     # tq4 K + tq3 V, hot "kv"
          (64, 1, 8, 64, 2, 4, 64, 1, "i32"),        # int8 K + tq4 V, hot "k"
          (256, 2, 5, 32, 2, 5, 32, 0, "i64")]       # tq5g32, no hot


@pytest.mark.parametrize("arch", [90, 121])
def test_kernel_compiles_for_gpus(arch):
    # H100/H200 (sm_90) and GB10 (sm_121) targets, no GPU needed: no register spills.
    specs = []
    for d, kk, kb, kg, vk, vb, vg, hot, slot in _CASES:
        # With hot tokens, also the new rows of a long hot prefill (the most work a program does).
        const = dict(D=d, K_KIND=kk, K_BITS=kb, K_GROUP=kg, V_KIND=vk, V_BITS=vb, V_GROUP=vg, HOT=hot, NEW_ROWS=hot)
        ptrs = dict(yk_ptr="fp32", yv_ptr="fp32", slot_ptr=slot, hot_slot_ptr=slot, kd_ptr=_STORE[kk],
                    ks_ptr="fp16", kcb_ptr="fp32", vd_ptr=_STORE[vk], vs_ptr="fp16", vcb_ptr="fp32",
                    hkd_ptr="i8", hks_ptr="fp16", hvd_ptr="i8", hvs_ptr="fp16", nkd_ptr="i8", nks_ptr="fp16",
                    nvd_ptr="i8", nvs_ptr="fp16")
        specs.append(spec("kvcache.tq_store_kernels:tq_store_kernel", arch, const, ptrs, tq_store_mod._num_warps(d)))
    assert_fit(_CASES, specs)
