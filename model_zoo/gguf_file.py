"""A GGUF file's header in one pass: its key/value metadata as plain Python
values and its tensors as gguf-py's ReaderTensor (data a read-only memmap
view, typed for float / int tensors and bytes for block types, exactly as
gguf.GGUFReader gives them, so gguf-py's dequantizers take them unchanged).

Why not gguf.GGUFReader: it builds one numpy view per array element of the
metadata, ~12 s (and more with another process busy) for Gemma 3's
262,144-token vocabulary, paid by every start of the server. This reads the
same values with struct from one buffer (tests/test_gguf_file.py checks it
against GGUFReader on the real files). Little-endian files only (llama.cpp
writes big-endian ones only on request)."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np

_SCALARS = {  # GGUFValueType -> struct format
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# Tensor types stored as typed elements (the others as bytes of blocks), as GGUFReader views them.
_TYPED = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}


class GGUFFile:
    """metadata: {key: value} (strings decoded, arrays as lists, the counts as
    GGUFReader names them: GGUF.version, GGUF.tensor_count, GGUF.kv_count);
    tensors: [gguf.ReaderTensor] in file order (field None; data None for
    a tensor past the end of a truncated file). Raises ValueError on a
    malformed header."""

    def __init__(self, path: str | Path):
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        self._pos = 0
        if self._scalar("I") != gguf.GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._scalar("I")
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file: not supported")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = self._scalar("Q"), self._scalar("Q")
        self.metadata: dict = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"duplicate key {key}")
            self.metadata[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar("Q") for _ in range(self._scalar("I"))]
            infos.append((name, dims, self._scalar("I"), self._scalar("Q")))
        align = self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align!r}")
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    # -- the header's values ----------------------------------------------------
    def _scalar(self, fmt: str):
        try:
            (v,) = struct.unpack_from("<" + fmt, self._buf, self._pos)
        except struct.error:
            raise ValueError(f"the header ends early (offset {self._pos} of {len(self._buf)} bytes)") from None
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar("Q")
        if len(self._buf) < self._pos + n:
            raise ValueError("string past the end of the file")
        s = str(self._buf[self._pos:self._pos + n], encoding="utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        itype, n = self._scalar("I"), self._scalar("Q")
        if itype in _NUMPY:     # numbers: one frombuffer
            dt = np.dtype(_NUMPY[itype]).newbyteorder("<")
            arr = np.frombuffer(self._buf, dtype=dt, count=n, offset=self._pos)
            self._pos += n * dt.itemsize
            return arr.tolist()
        out = []
        for _ in range(n):      # strings; arrays of arrays flatten, as GGUFReader's contents() does
            v = self._value(itype)
            out.extend(v) if itype == _ARRAY else out.append(v)
        return out

    def _tensor(self, start: int, name: str, dims: list[int], raw_type: int, offset: int) -> gguf.ReaderTensor:
        qtype = gguf.GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims)) if dims else 1
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        np_dims = tuple(reversed(dims))
        if qtype in _TYPED:
            dt, count = np.dtype(_TYPED[qtype]), n_elems
        else:
            dt, count = np.dtype(np.uint8), n_bytes
            np_dims = gguf.quant_shape_to_byte_shape(np_dims, qtype)
        at = start + offset
        # Past the end of a truncated file: data None (the loader names the tensor and the sizes).
        data = self.data[at:at + count * dt.itemsize].view(dt).reshape(np_dims) \
            if at + count * dt.itemsize <= len(self.data) else None
        return gguf.ReaderTensor(name=name, tensor_type=qtype, shape=np.array(dims, dtype=np.uint64),
                                 n_elements=n_elems, n_bytes=n_bytes, data_offset=at, data=data, field=None)
