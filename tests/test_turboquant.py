"""TurboQuant codec and compressed-block attention: Lloyd-Max codebooks,
rotation, bit packing, round-trip MSE (Gaussian and real K/V), attention over
compressed blocks vs attention over the dequantized vectors, formats, policy
and the pool's capacity accounting."""
import math

import pytest
import torch

from kvcache.dense_cache import DenseLayerCache
from kvcache.kv_formats import PRESETS, KVPolicy, component, parse_preset
from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.pool_plan import allocate_kv_caches, kv_dtype, make_layer_cache, plan_kv_pool
from kvcache.spec import LayerSpec
from kvcache.tq_cache import TQLayerCache
from kvcache.turboquant import (INT8, LLOYD_MAX_MSE, Codec, codebook_mse, fwht, lloyd_max, pack_bits, rotate,
                                rotation_signs, tq, unit_mse, unpack_bits, unrotate)

HEAD_DIMS = [64, 128, 256, 512]


# -- codec --------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_codebook_matches_design_values(bits):
    c, mse = lloyd_max(bits)
    assert len(c) == 2 ** bits and list(c) == sorted(c)
    assert all(abs(a + b) < 1e-9 for a, b in zip(c, reversed(c)))          # symmetric
    assert abs(mse - LLOYD_MAX_MSE[bits]) / LLOYD_MAX_MSE[bits] < 2e-3
    assert mse > 4.0 ** -bits                                              # above the bound
    # Monte Carlo check of the closed form.
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(bits), dtype=torch.float64)
    ct = torch.tensor(c, dtype=torch.float64)
    q = ct[torch.bucketize(x, (ct[1:] + ct[:-1]) / 2)]
    assert abs(float(((x - q) ** 2).mean()) - mse) / mse < 0.02


@pytest.mark.parametrize("d", [16] + HEAD_DIMS)
def test_rotation_is_orthogonal_and_deterministic(d):
    s = rotation_signs(d, 7)
    assert torch.equal(s, rotation_signs(d, 7)) and not torch.equal(s, rotation_signs(d, 8))
    x = torch.randn(5, d, dtype=torch.float64)
    y = rotate(x, s.double())
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.allclose(unrotate(y, s.double()), x)
    q = torch.randn(3, d, dtype=torch.float64)
    assert torch.allclose(rotate(q, s.double()) @ y.T, q @ x.T)
    # the FWHT is the (normalised) Sylvester Hadamard matrix
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    assert torch.allclose(fwht(x), x @ H / math.sqrt(d))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_bits_exact_size_and_roundtrip(bits):
    codes = torch.randint(0, 2 ** bits, (7, 3, 64))
    p = pack_bits(codes, bits)
    assert p.dtype == torch.uint8 and p.shape == (7, 3, 64 * bits // 8)
    assert torch.equal(unpack_bits(p, bits, 64), codes)
    if bits == 3:   # 8 codes in exactly 3 bytes, little-endian bit order
        p8 = pack_bits(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]]), 3)
        v = sum(c << (3 * i) for i, c in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
        assert p8.tolist() == [[v & 255, (v >> 8) & 255, v >> 16]]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_roundtrip_mse_within_5pct_of_lloyd_max(bits, d):
    """Rotated Gaussian vectors are uniform on the sphere: the codebook (Lloyd-Max
    for a sphere coordinate) attains its own MSE, a little below the Gaussian
    Lloyd-Max value at small dims and converging to it as d grows."""
    y = torch.randn(max(4000, 400_000 // d), d, generator=torch.Generator().manual_seed(d + bits))
    mse = unit_mse(y, bits)
    assert abs(mse - codebook_mse(bits, d)) / codebook_mse(bits, d) < 0.02, mse
    assert -0.06 < codebook_mse(bits, d) / LLOYD_MAX_MSE[bits] - 1 < 0, codebook_mse(bits, d)


@pytest.mark.parametrize("fmt", [tq(2), tq(3), tq(4), tq(3, 32), tq(4, 64), INT8, component("f16")])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_storage_bytes_equal_format_bits(fmt, d):
    H = 2
    c = Codec(fmt, H, d, seed=1)
    rows = c.alloc(10, "cpu")
    nbytes = sum(t.numel() * t.element_size() for t in rows.values())
    if fmt.kind == "tq":
        g = fmt.group or d
        expect = 10 * H * (d * fmt.bits // 8 + 2 * (d // g))
    elif fmt.kind == "int8":
        expect = 10 * H * (d + 2)
    else:
        expect = 10 * H * d * 2
    assert nbytes == expect
    # encode produces rows of exactly the stored shapes and dtypes; the norm
    # correction keeps each (sub-)vector's length
    x = torch.randn(10, H, d) * 3
    enc = c.encode(x)
    assert {k: (v.shape, v.dtype) for k, v in enc.items()} == {k: (v.shape, v.dtype) for k, v in rows.items()}
    rec = c.dequantize(enc)
    if fmt.kind == "tq":
        g = fmt.group or d
        yn = rotate(x, c.signs).view(10, H, d // g, g).norm(dim=-1)
        rn = c.decode(enc).view(10, H, d // g, g).norm(dim=-1)
        assert torch.allclose(yn, rn, rtol=2e-3)
    rel = float((rec - x).pow(2).sum() / x.pow(2).sum())
    bound = {2: 0.2, 3: 0.06, 4: 0.02, 8: 1e-3, 16: 1e-5}[fmt.bits]
    assert rel < bound, rel


# -- attention over compressed blocks -------------------------------------------
def _build(specs, block_size, num_blocks, seed=0):
    """Random paged layout: specs is a list of (context_len, query_len) per sequence
    (decodes first). Returns the cache with every token written, and metadata."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots_all, qsl = [], [], [0]
    max_blocks = max(-(-n // block_size) for n, _ in specs)
    for n, lq in specs:
        nb = -(-n // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks + [0] * (max_blocks - nb))
        slots_all.append(torch.tensor([blocks[p // block_size] * block_size + p % block_size
                                       for p in range(n)]))
        qsl.append(qsl[-1] + lq)
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=[n for n, _ in specs],
        num_decodes=next((i for i, (_, lq) in enumerate(specs) if lq != 1), len(specs)),
        groups=[GroupMetadata(torch.cat([s[-lq:] for s, (_, lq) in zip(slots_all, specs)]),
                              torch.tensor(tables))])
    return torch.cat(slots_all), meta


CASES = [  # (Hq, Hkv, head_dim, block_size, window)
    (4, 1, 64, 4, None), (6, 2, 128, 16, None), (2, 2, 256, 4, 7), (8, 2, 512, 8, None),
    (3, 3, 64, 16, 20), (4, 2, 128, 4, 5),
]
FORMATS = sorted({parse_preset(p) for p in PRESETS} - {parse_preset("f16")}, key=str) + \
    [(component("f16"), component("tq3"))]


@pytest.mark.parametrize("kv", FORMATS, ids=lambda kv: f"k{kv[0].name}-v{kv[1].name}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}-{}-d{}-bs{}-w{}".format(*c))
def test_compressed_attention_equals_dequantized_attention(kv, case):
    Hq, H, D, bs, window = case
    kf, vf = kv
    # decodes first (query_len 1), then prefills: whole prompt, and a chunk on a prefix
    seqs = [(1, 1), (bs * 3 + 1, 1), (bs * 5 - 1, 1), (bs * 2 + 3, bs * 2 + 3), (bs * 6 + 2, bs + 3)]
    num_blocks = 40
    torch.manual_seed(hash(case) % 1000)
    tq_cache = TQLayerCache(num_blocks, bs, H, D, kf, vf, 0, window, seed=3, chunk_tokens=2 * bs)
    ref = DenseLayerCache(num_blocks, bs, H, D, torch.float32, 0, window)
    slots, meta = _build(seqs, bs, num_blocks)
    N = slots.numel()
    k = torch.randn(N, H, D) * 2 + 0.5
    v = torch.randn(N, H, D)
    tq_cache.write(slots, k, v)
    kd, vd = tq_cache.dequantized(slots)
    ref.write(slots, kd, vd)
    T = meta.query_start_loc[-1]
    q = torch.randn(T, Hq, D)
    scale = D ** -0.5
    out = tq_cache.attention(q, meta, scale)
    exp = ref.attention(q, meta, scale)
    assert out.shape == exp.shape
    assert torch.allclose(out, exp, atol=2e-5, rtol=1e-4), (out - exp).abs().max()
    # and the dequantized vectors are close to the originals (format sanity)
    if kf.kind != "f16":
        assert float((kd - k).pow(2).sum() / k.pow(2).sum()) < 0.2


@pytest.mark.parametrize("kv", ["tq4", "k4v3", "tq3", "k8v4"])
def test_centred_keys_leave_attention_unchanged(kv):
    """Keys stored minus a per-head mean: compressed attention still equals
    attention over the dequantized (mean added back) keys, and keys with a
    large shared offset reconstruct far better than uncentred ones."""
    Hq, H, D, bs = 6, 2, 64, 8
    kf, vf = parse_preset(kv)
    seqs = [(bs * 3 + 1, 1), (bs * 4 + 2, bs + 3)]
    slots, meta = _build(seqs, bs, 30)
    N = slots.numel()
    torch.manual_seed(7)
    mean = torch.randn(H, D) * 4
    k, v = torch.randn(N, H, D) + mean, torch.randn(N, H, D)
    plain = TQLayerCache(30, bs, H, D, kf, vf, 0, None, seed=3, chunk_tokens=2 * bs)
    centred = TQLayerCache(30, bs, H, D, kf, vf, 0, None, seed=3, chunk_tokens=2 * bs)
    centred.set_key_mean(k.mean(0))
    q = torch.randn(meta.query_start_loc[-1], Hq, D)
    errs = []
    for c in (plain, centred):
        c.write(slots, k, v)
        kd, vd = c.dequantized(slots)
        ref = DenseLayerCache(30, bs, H, D, torch.float32, 0, None)
        ref.write(slots, kd, vd)
        out, exp = c.attention(q, meta, D ** -0.5), ref.attention(q, meta, D ** -0.5)
        assert torch.allclose(out, exp, atol=2e-5, rtol=1e-4), (out - exp).abs().max()
        errs.append(float((kd - k).pow(2).sum() / (k - k.mean(0)).pow(2).sum()))
    assert errs[1] < errs[0] / 3, errs


def test_decode_is_batch_invariant():
    """A sequence's decode output does not depend on its batch (to float
    rounding: the dense path is not bitwise either)."""
    H, D, bs = 2, 64, 4
    c = TQLayerCache(30, bs, H, D, tq(4), tq(3), 0, seed=1, chunk_tokens=8)
    seqs = [(9, 1), (30, 1), (2, 1)]
    slots, meta = _build(seqs, bs, 30)
    c.write(slots, torch.randn(slots.numel(), H, D), torch.randn(slots.numel(), H, D))
    q = torch.randn(3, 4, D)
    full = c.attention(q, meta, 0.125)
    for i in range(3):
        one = AttentionMetadata([0, 1], [meta.seq_lens[i]], 1,
                                [GroupMetadata(meta.groups[0].slot_mapping[i:i + 1],
                                               meta.groups[0].block_tables[i:i + 1])])
        assert torch.allclose(c.attention(q[i:i + 1], one, 0.125)[0], full[i], atol=2e-6, rtol=0)


# -- formats, policy, capacity ---------------------------------------------------
def test_presets_and_overrides():
    assert parse_preset("tq4") == (tq(4), tq(4))
    assert parse_preset("k8v4") == (INT8, tq(4))
    assert parse_preset("k4v3") == (tq(4), tq(3))
    assert parse_preset("k3v3g32") == (tq(3, 32), tq(3, 32))
    assert parse_preset("k8v3g32") == (INT8, tq(3, 32))
    for bad in ("tq5", "k9v4", "k4", "q4_0"):
        with pytest.raises(ValueError):
            parse_preset(bad)
    assert kv_dtype("auto", torch.float32) is torch.float32
    assert kv_dtype("f16", torch.float32) is torch.float16
    p = kv_dtype("tq4", torch.float32, k="q8", protect_layers=1)
    assert isinstance(p, KVPolicy) and (p.k, p.v, p.protect_layers) == (INT8, tq(4), 1)
    p = kv_dtype("f16", torch.float32, v="tq3")
    assert (p.k.kind, p.v) == ("f16", tq(3))
    with pytest.raises(ValueError):
        kv_dtype("tq4", torch.float32, k="tq7")


def test_layer_policy_protects_first_last_and_sliding():
    pol = KVPolicy.from_names("k4v3", protect_layers=2)
    specs = [LayerSpec(i, 2, 64, 512 if i % 3 == 1 else None) for i in range(8)]
    caches = [make_layer_cache(s, 2, 16, pol, 0, 8) for s in specs]
    kinds = ["dense" if isinstance(c, DenseLayerCache) else "tq" for c in caches]
    assert kinds == ["dense", "dense", "tq", "tq", "dense", "tq", "dense", "dense"]
    assert all(c.k.dtype == torch.float16 for c in caches if isinstance(c, DenseLayerCache))
    quant_sliding = KVPolicy.from_names("k4v3", quantize_sliding=True)
    assert isinstance(make_layer_cache(specs[4], 2, 16, quant_sliding, 0, 8), TQLayerCache)
    # per-layer rotation seeds: deterministic, different across layers
    a, b = caches[2], caches[3]
    assert not torch.equal(a.signs, b.signs)
    assert torch.equal(a.signs, make_layer_cache(specs[2], 1, 16, pol, 0, 8).signs)
    with pytest.raises(ValueError, match="power-of-two"):
        make_layer_cache(LayerSpec(3, 2, 80), 1, 16, pol, 0, 8)


@pytest.mark.parametrize("head_dim,kv_heads", [(64, 3), (128, 8)])
def test_capacity_at_fixed_budget(head_dim, kv_heads):
    """Sequences of 2,048 tokens that fit in a fixed budget, from the pool's own
    plan, whose block bytes equal the real tensors' sizes. The plan is made
    for as many running sequences as fit, so the hot tokens' blocks (2 int8
    key blocks per sequence + 8) come out of the same budget."""
    specs = [LayerSpec(i, kv_heads, head_dim) for i in range(4)]
    bs, ctx = 16, 2048
    budget = 10 * ctx * len(specs) * kv_heads * head_dim * 2 * 2     # f16 holds exactly 10
    fits = {}
    for name in ("f16", "tq4", "tq3", "k8v4", "k4v3"):
        dt = kv_dtype(name, torch.float32)

        def plan_for(n):
            return plan_kv_pool(specs, budget, bs, dt, max_num_seqs=n, max_num_batched_tokens=2048)
        n = max(n for n in range(1, 80) if plan_for(n).num_blocks[0] * bs // ctx >= n)
        plan = plan_for(n)
        real = sum(make_layer_cache(s, 3, bs, dt, 0, len(specs)).nbytes for s in specs)
        assert 3 * plan.block_bytes[0] == real
        hot = [gi for gi, g in enumerate(plan.groups) if g.hot]
        if name in ("tq4", "tq3", "k4v3"):          # TurboQuant K: hot keys, int8, 2 blocks a sequence
            c = allocate_kv_caches(specs, plan, dt)[0]
            assert plan.block_bytes[hot[0]] == len(specs) * c.hk["q"][:bs].nbytes * (head_dim + 2) // head_dim
            assert plan.num_blocks[hot[0]] == 2 * n + 8 and plan.hot_bytes_per_seq > 0
        else:
            assert not hot
        assert plan.total_bytes <= budget
        fits[name] = n
    assert fits["f16"] == 10
    assert fits["tq4"] >= 3.7 * fits["f16"], fits
    assert fits["tq3"] >= 4.8 * fits["f16"], fits
    assert fits["k4v3"] > fits["tq4"] and fits["k8v4"] < fits["tq4"]


def test_choose_split_least_error_within_budget():
    from kvcache.kv_formats import KV_MENU, choose_split
    # bits = K + V per layer; K errors weigh 4x V errors
    opts = {i: {(k, v): (k + v, 4 * 2.0 ** -k + 2.0 ** -v + i) for k, v in KV_MENU} for i in range(3)}
    assert choose_split(opts, 4) == (5, 3)
    assert choose_split(opts, 3) == (4, 2)
    assert choose_split(opts, 2) == (2, 2)
