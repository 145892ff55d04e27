"""The compiled CPU attention kernel (kvcache.tq_cpu) against the torch
reference (TQLayerCache._attend_torch): every component format, mixed K/V
formats, head_dim 64/128/256, GQA 1 and 3, lengths on and across block
boundaries, batched decodes of different lengths, sliding windows, prefill
chunks starting mid-sequence and spanning several row tiles, bf16 queries;
and a build failure is an error that says what to do."""
import pytest
import torch

from kvcache import tq_cpu
from kvcache.turboquant import F16, INT8, tq
from tq_paged import BS, assert_close, paged_cache

FORMATS = {"f16": F16, "int8": INT8, "tq2": tq(2), "tq3": tq(3), "tq4": tq(4), "tq4g32": tq(4, 32),
           "tq3g32": tq(3, 32), "tq2g64": tq(2, 64)}
try:                      # 5-bit codes where the codec has them (the kernel reads any width <= 8)
    FORMATS["tq5"] = tq(5)
except ValueError:
    pass


def _close(out, ref, rel=2e-5):
    assert_close(out, ref, rel)


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


@pytest.mark.parametrize("kf,vf", [("tq4", "tq3"), ("int8", "tq4")])
def test_decode_entry_point_equals_torch_path(kf, vf, monkeypatch):
    """_decode's kernel path (rotation by a [D, D] matmul) vs the torch path."""
    lens = [40, 3, 77]
    c, bt = paged_cache(FORMATS[kf], FORMATS[vf], 3, 64, lens, window=None)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(2))
    out = c._decode(q, bt, torch.tensor(lens), 0.125)
    monkeypatch.setenv("TQSERVE_TQ_CPU", "torch")
    _close(out, c._decode(q, bt, torch.tensor(lens), 0.125))
