"""The compiled CPU attention kernel (kvcache.tq_cpu) against the torch
reference (TQLayerCache._attend_torch), output and log-sum-exp: every
component format, mixed K/V formats, head_dim 64/128/256, GQA 1 and 3,
lengths on and across block boundaries, batched decodes of different lengths,
sliding windows, prefill chunks starting mid-sequence and spanning several row
tiles, bf16 queries; the hot-token passes (CODED / HOT keys, values through
their own block table, rows that see no key) and the _decode / _prefill entry
points with hot tokens; and a build failure is an error that says what to do."""
import pytest
import torch

from kvcache import tq_cpu
from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.tq_cache import CODED, HOT, merge
from kvcache.turboquant import F16, INT8, tq
from test_backends import SPAN_LENS, masked_sdpa, span_meta
from tq_paged import BS, assert_close, paged_cache

FORMATS = {"f16": F16, "int8": INT8, "tq2": tq(2), "tq3": tq(3), "tq4": tq(4), "tq4g32": tq(4, 32),
           "tq3g32": tq(3, 32), "tq2g64": tq(2, 64)}
try:                      # 5-bit codes where the codec has them (the kernel reads any width <= 8)
    FORMATS["tq5"] = tq(5)
except ValueError:
    pass


def _close(res, ref, rel=2e-5):
    """(out, lse) pairs: outputs within rel; lse -inf on the same rows (no
    visible key, output 0 there) and within rel of the largest elsewhere."""
    (out, lse), (ref_out, ref_lse) = res, ref
    assert_close(out, ref_out, rel)
    assert lse.dtype == ref_lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert not out[empty].any()
    if not empty.all():
        _close_tensor(lse[~empty], ref_lse[~empty], rel)


def _close_tensor(x, ref, rel):
    err = float((x - ref).abs().max())
    assert err <= rel * max(1.0, float(ref.abs().max())), err


def _check_decode(kf, vf, H, G, D, lens, window=None, dtype=torch.float32, rel=2e-5):
    c, bt = paged_cache(kf, vf, H, D, lens, window)
    q = torch.randn(len(lens), H * G, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    seq = torch.tensor(lens)
    qr = c._rotate_q(q.unsqueeze(1), D ** -0.5)
    cols = c.decode_columns(bt, seq)
    qpos = (seq - 1)[:, None]
    _close(tq_cpu.attend(c, qr, cols, bt, qpos, seq), c._attend_torch(qr, cols, bt, qpos, seq), rel)


def _check_prefill(kf, vf, H, G, D, seq_len, q_len, window=None):
    c, bt = paged_cache(kf, vf, H, D, [seq_len], window)
    q = torch.randn(q_len, H * G, D, generator=torch.Generator().manual_seed(5))
    start = seq_len - q_len
    lo = 0 if window is None else max(0, start - window + 1)
    cols = torch.arange(lo // BS, -(-seq_len // BS))[None]
    qpos = torch.arange(start, seq_len)[None]
    qr = c._rotate_q(q.unsqueeze(0), D ** -0.5)
    seq = torch.tensor([seq_len])
    _close(tq_cpu.attend(c, qr, cols, bt[:1], qpos, seq), c._attend_torch(qr, cols, bt[:1], qpos, seq))


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decode_every_format(fmt, G):
    # one token, exactly one block, just past it, mid-block, two blocks + 1
    _check_decode(FORMATS[fmt], FORMATS[fmt], 2, G, 64, [1, 16, 17, 40, 33])


@pytest.mark.parametrize("kf,vf", [("int8", "tq4"), ("tq4", "tq3"), ("tq3", "f16"), ("tq4g32", "tq2"),
                                   ("f16", "int8"), ("tq2", "tq4g32")])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_decode_mixed_formats_head_dims(kf, vf, D):
    _check_decode(FORMATS[kf], FORMATS[vf], 2, 3, D, [5, 31, 50])


@pytest.mark.parametrize("fmt", ["tq4", "int8", "tq3g32"])
def test_decode_sliding_window(fmt):
    # windows shorter than, equal to and not a multiple of the block size
    for w in (7, 16, 37):
        _check_decode(FORMATS[fmt], FORMATS["tq3"], 2, 3, 64, [3, 36, 80, 100], window=w)


@pytest.mark.parametrize("kf,vf", [("tq4", "tq3"), ("int8", "tq4"), ("f16", "tq2"), ("tq3g32", "tq3g32")])
def test_prefill_chunks(kf, vf):
    # whole prompt, a chunk starting mid-block, and one spanning several row tiles
    for seq_len, q_len in ((37, 37), (50, 19), (3 * tq_cpu.ROW_TILE + 70, 3 * tq_cpu.ROW_TILE + 5)):
        _check_prefill(FORMATS[kf], FORMATS[vf], 3, 3, 64, seq_len, q_len)


def test_prefill_sliding_window():
    for w in (5, 16, 40):
        _check_prefill(tq(4), tq(3), 1, 3, 128, 90, 41, window=w)


def test_bf16_queries():
    # the kernel computes in float32 from bf16 inputs; the reference in bf16
    _check_decode(tq(4), tq(3), 3, 3, 64, [200, 77], dtype=torch.bfloat16, rel=2e-2)


def test_long_decode_batch():
    _check_decode(tq(4), tq(3), 3, 3, 64, [1000, 513, 64, 1])


def test_torch_path_selected_by_env(monkeypatch):
    c, bt = paged_cache(tq(4), tq(4), 1, 64, [20])
    seq = torch.tensor([20])
    q = torch.randn(1, 2, 64)
    calls = []
    monkeypatch.setattr(tq_cpu, "attend", lambda cache, *a: calls.append(1) or cache._attend_torch(*a))
    monkeypatch.setenv("TQSERVE_TQ_CPU", "torch")
    c._decode(q, bt, seq, 0.125)
    assert not calls
    monkeypatch.delenv("TQSERVE_TQ_CPU")
    c._decode(q, bt, seq, 0.125)
    assert calls


def test_build_failure_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TQSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(tq_cpu, "FLAGS", tq_cpu.FLAGS + ["-DTQ_FORCE_FAIL", "-include", "/nonexistent.h"])
    with pytest.raises(RuntimeError, match="TQSERVE_TQ_CPU=torch"):
        tq_cpu._lib.__wrapped__()
    assert not list(tmp_path.iterdir())     # no partial library left behind


def test_scalar_decoders_without_avx2(monkeypatch, tmp_path):
    """The portable (no AVX2) 3- and 4-bit decoders equal the torch reference too."""
    monkeypatch.setenv("TQSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(tq_cpu, "FLAGS", tq_cpu.FLAGS + ["-mno-avx2"])
    monkeypatch.setattr(tq_cpu, "_lib", tq_cpu._lib.__wrapped__)    # build this variant, uncached
    for kf, vf in (("tq4", "tq3"), ("tq3", "tq4")):
        _check_decode(FORMATS[kf], FORMATS[vf], 2, 3, 64, [5, 40, 33])


@pytest.mark.parametrize("kf,vf", [("tq4", "tq3"), ("int8", "tq4")])
def test_decode_entry_point_equals_torch_path(kf, vf, monkeypatch):
    """_decode's kernel path (rotation by a [D, D] matmul) vs the torch path."""
    lens = [40, 3, 77]
    c, bt = paged_cache(FORMATS[kf], FORMATS[vf], 3, 64, lens, window=None)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(2))
    out = c._decode(q, bt, torch.tensor(lens), 0.125)
    monkeypatch.setenv("TQSERVE_TQ_CPU", "torch")
    assert_close(out, c._decode(q, bt, torch.tensor(lens), 0.125), 2e-5)


# -- hot tokens: the CODED and HOT passes ------------------------------------

PAIRS = [("tq3", "tq3"), ("tq4", "tq4"), ("int8", "int8"), ("tq4", "tq3")]


def _tables(part, hot, bt, ht):
    """(key tables, value tables) a pass reads: hot keys (and with "kv" hot
    values) through the hot group's table, everything else the main one's."""
    if part == HOT:
        return ht, ht if hot == "kv" else bt
    return bt, bt


def _check_parts(c, bt, ht, qr, cols, qpos, seq, hot):
    refs = []
    for part in (CODED, HOT):
        kt, vt = _tables(part, hot, bt, ht)
        refs.append(c._attend_torch(qr, cols, kt, qpos, seq, part, vt))
        _close(tq_cpu.attend(c, qr, cols, kt, qpos, seq, part, vt), refs[-1])
    # both passes in one call (one online softmax) == the two merged
    passes = [(part, cols, *_tables(part, hot, bt, ht)) for part in (HOT, CODED)]
    _close(tq_cpu.attend_passes(c, qr, passes, qpos, seq),
           (merge(*refs[0], *refs[1]), torch.logaddexp(refs[0][1], refs[1][1])))


@pytest.mark.parametrize("G,D", [(1, 64), (3, 128)])
@pytest.mark.parametrize("hot", ["k", "kv"])
@pytest.mark.parametrize("kf,vf", PAIRS)
def test_decode_parts(kf, vf, hot, G, D):
    # one token; own block == block 0 (no coded key); block boundaries; several blocks
    lens = [1, 15, 16, 17, 33, 80]
    c, bt, ht = paged_cache(FORMATS[kf], FORMATS[vf], 2, D, lens, hot=hot)
    q = torch.randn(len(lens), 2 * G, D, generator=torch.Generator().manual_seed(7))
    seq = torch.tensor(lens)
    qr = c._rotate_q(q.unsqueeze(1), D ** -0.5)
    qpos = (seq - 1)[:, None]
    _check_parts(c, bt, ht, qr, c.decode_columns(bt, seq), qpos, seq, hot)
    # the columns _decode reads: block 0 and the own block (a masked block 1 when they coincide)
    own = (seq - 1) // BS
    _check_parts(c, bt, ht, qr, torch.stack([torch.zeros_like(own), own.clamp(min=1)], 1), qpos, seq, hot)


@pytest.mark.parametrize("G,D", [(1, 128), (3, 64)])
@pytest.mark.parametrize("hot", ["k", "kv"])
@pytest.mark.parametrize("kf,vf", PAIRS)
def test_prefill_parts(kf, vf, hot, G, D):
    # whole prompt (queries in blocks 0/1: rows with no coded key), chunks
    # starting mid-block and on a boundary, one spanning several row tiles
    for seq_len, q_len in ((37, 37), (50, 29), (70, 38), (3 * tq_cpu.ROW_TILE + 70, 3 * tq_cpu.ROW_TILE + 5)):
        c, bt, ht = paged_cache(FORMATS[kf], FORMATS[vf], 2, D, [seq_len], hot=hot)
        q = torch.randn(q_len, 2 * G, D, generator=torch.Generator().manual_seed(5))
        qr = c._rotate_q(q.unsqueeze(0), D ** -0.5)
        cols = torch.arange(-(-seq_len // BS))[None]
        _check_parts(c, bt, ht, qr, cols, torch.arange(seq_len - q_len, seq_len)[None],
                     torch.tensor([seq_len]), hot)


def test_parts_rows_without_keys():
    # CODED for queries in blocks 0 and 1 sees nothing: output 0, lse -inf
    c, bt, ht = paged_cache(tq(4), tq(3), 2, 64, [32], hot="k")
    qr = c._rotate_q(torch.randn(1, 32, 6, 64), 0.125)
    out, lse = tq_cpu.attend(c, qr, torch.arange(2)[None], bt, torch.arange(32)[None], torch.tensor([32]), CODED)
    assert torch.isneginf(lse).all() and not out.any()


def _hot_prefill(c, bt, ht, seq_len, q, seed):
    """_prefill of the last q.shape[0] positions, after store() wrote them:
    its hot pass takes the chunk's own rows from there."""
    n, H, D = q.shape[0], c.num_kv_heads, c.head_dim
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, H, D, generator=g) * 2 + 0.5, torch.randn(n, H, D, generator=g)
    pos = torch.arange(seq_len - n, seq_len)
    groups = [GroupMetadata(t[pos // BS] * BS + pos % BS, t[None]) for t in (bt, ht)]
    c.store(AttentionMetadata([0, n], [seq_len], 0, groups, [c]), k, v)
    return c._prefill(q, bt, seq_len, 0.125, ht)


@pytest.mark.parametrize("hot", ["k", "kv"])
def test_hot_entry_points_equal_torch_path(hot, monkeypatch):
    """_decode / _prefill with hot tokens (two passes merged): kernel vs torch path."""
    lens = [1, 16, 17, 40, 80]
    c, bt, ht = paged_cache(tq(4), tq(3), 3, 64, lens, hot=hot)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(2))
    seq = torch.tensor(lens)
    out = c._decode(q, bt, seq, 0.125, ht)
    monkeypatch.setenv("TQSERVE_TQ_CPU", "torch")
    assert_close(out, c._decode(q, bt, seq, 0.125, ht), 2e-5)
    # whole prompt, chunks starting mid-block and on a boundary, one token
    for L, n in ((80, 80), (80, 23), (80, 48), (40, 9), (17, 1)):
        i = lens.index(L)
        x = torch.randn(n, 9, 64, generator=torch.Generator().manual_seed(n))
        monkeypatch.setenv("TQSERVE_TQ_CPU", "kernel")
        out = _hot_prefill(c, bt[i], ht[i], L, x, n)
        monkeypatch.setenv("TQSERVE_TQ_CPU", "torch")
        assert_close(out, _hot_prefill(c, bt[i], ht[i], L, x, n), 2e-5)


# -- key limits (bidirectional spans) ------------------------------------------
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_key_limits_bidirectional_span(path, window, monkeypatch):
    """tq-cpu (the kernel, and its torch path: tq-torch's code) with key
    limits == SDPA with the span mask over the decoded K/V; a window still
    counts from the query's own position (8: the chunk's queries lose the
    span's first keys but keep its last)."""
    monkeypatch.setenv("TQSERVE_TQ_CPU", path)
    c, bt = paged_cache(tq(4), tq(3), 2, 64, SPAN_LENS, window)
    assert c.backend.name == "tq-cpu" and c.no_key_limits is None
    meta, pos, lim = span_meta([bt])
    q = torch.randn(len(pos), 6, 64, generator=torch.Generator().manual_seed(3))

    def kv(i, L):
        return c.dequantized(bt[i, torch.arange(L) // BS] * BS + torch.arange(L) % BS)
    out = c.attention(q, meta, 0.125)
    assert_close(out, masked_sdpa(q, kv, meta, pos, lim, 0.125, window), 2e-5)
    meta.key_limits_t = None
    causal = c.attention(q, meta, 0.125)
    assert_close(causal, masked_sdpa(q, kv, meta, pos, pos, 0.125, window), 2e-5)
    differs = (out - causal).abs().amax((1, 2)) > 1e-3
    assert torch.equal(differs, lim > pos)         # exactly the rows that see past themselves
