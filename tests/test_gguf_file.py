"""model_zoo/gguf_file.py reads what gguf-py's GGUFReader reads: the same
metadata values (every value type, arrays of strings and numbers) and the
same tensors (name, type, shape, offset, bytes, data), on a file with every
value type and on the two real models, in a fraction of the time."""
import time

import gguf
import numpy as np
import pytest
from fixtures_models import REAL_MODELS, gguf_path, write_tiny_gguf

from model_zoo.gguf_file import GGUFFile
from model_zoo.tokenizer import gguf_metadata


def assert_same(path) -> tuple[float, float]:
    t0 = time.perf_counter()
    ref = gguf.GGUFReader(path)
    want = gguf_metadata(ref)
    t1 = time.perf_counter()
    ours = GGUFFile(path)
    t2 = time.perf_counter()
    assert ours.metadata == want
    assert {k: type(v) for k, v in ours.metadata.items()} == {k: type(v) for k, v in want.items()}
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == \
            (b.name, b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data[:2], b.data[:2], equal_nan=a.data.dtype.kind == "f")
        assert np.array_equal(a.data[-1:], b.data[-1:], equal_nan=a.data.dtype.kind == "f")
    return t1 - t0, t2 - t1


def test_every_value_type(tmp_path):
    path = tmp_path / "values.gguf"
    write_tiny_gguf(path, qtype="Q4_K")       # a block type, F32 norms
    w = gguf.GGUFWriter(str(tmp_path / "kv.gguf"), "llama")
    w.add_uint8("u8", 200)
    w.add_int8("i8", -100)
    w.add_uint16("u16", 60000)
    w.add_int16("i16", -30000)
    w.add_uint32("u32", 4_000_000_000)
    w.add_int32("i32", -2_000_000_000)
    w.add_float32("f32", 0.1)
    w.add_uint64("u64", 2 ** 63 + 5)
    w.add_int64("i64", -(2 ** 62))
    w.add_float64("f64", 0.1)
    w.add_bool("yes", True)
    w.add_string("text", "h\u00e9llo \u2581 \U0001F600")
    w.add_array("ints", [1, -2, 3])
    w.add_array("floats", [0.5, 1.25])
    w.add_array("strings", ["a", "", "\u00fc"])
    w.add_array("bools", [True, False])
    w.add_array("empty", [])
    w.add_tensor("t16", np.arange(6, dtype=np.float16).reshape(2, 3))
    w.add_tensor("t32", np.arange(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, tmp_path / "kv.gguf"):
        assert_same(p)
    meta = GGUFFile(tmp_path / "kv.gguf").metadata
    assert (meta["u64"], meta["f32"], meta["text"], meta["strings"]) == \
        (2 ** 63 + 5, float(np.float32(0.1)), "h\u00e9llo \u2581 \U0001F600", ["a", "", "\u00fc"])


@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_files(name):
    slow, fast = assert_same(gguf_path(name))
    print(f"{name}: GGUFReader {slow:.2f} s, GGUFFile {fast:.2f} s")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="GGUF magic invalid"):
        GGUFFile(bad)
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:200])        # inside the header
    with pytest.raises(ValueError, match="ends early|past the end"):
        GGUFFile(cut)
