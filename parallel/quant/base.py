"""How a linear layer holds its weight and multiplies by it (vLLM's
QuantizeMethodBase shape): one object per layer, `LinearBase.quant`.

- Dense: the layer's `weight` Parameter, F.linear.
- Int4Cpu: torch's int4 CPU kernel on weights repacked from exact 4-bit
  groups (GGUF Q4_1), `--quantization int4`.
- GGUFBlocks: the GGUF file's quantized rows kept as they are stored
  (`--quantization gguf`): per shard of the layer (q / k / v, gate / up) its
  own type. Under tensor parallelism the layer cuts each checkpoint tensor
  (QuantizedTensor.narrow) as it cuts a dense one: a column-parallel rank
  keeps its rows, a row-parallel one its columns, on the type's blocks.
  CPU: a fused C++ GEMV for up to 8-24 rows by type (gguf_cpu.gemv_max_m),
  else the weight dequantized TILE_ELEMENTS at a time into one buffer shared
  by all layers, each tile multiplied into its output columns (the host
  never holds a dense layer); CUDA: the Triton kernels of
  parallel/quant/gguf.py, dequantizing in registers.

- GGUFExperts: a MoE layer's routed experts as the GGUF file stacks them
  (ffn_{gate,up,down}_exps: one [E, rows, row_bytes] tensor per projection,
  each its own type), this rank's range; each expert with tokens is
  dequantized into the shared buffer on its turn (parallel/quant/moe.py).

A checkpoint tensor kept in its stored format travels from the loader to the
layer as a QuantizedTensor.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parallel.int4 import int4_linear
from parallel.quant import fp8_block, gguf, gguf_cpu, moe


@dataclass
class QuantizedTensor:
    """A weight as stored, for a logical [rows, cols] matrix (or [experts,
    rows, cols]) in format `fmt`: a GGUF type name (data: uint8 rows of
    blocks), "fp8" (data: float8_e4m3fn, scale: 128x128 block scales) or
    "mxfp4" (data: e2m1 codes two per byte, scale: E8M0 per 32)."""
    fmt: str
    data: torch.Tensor
    shape: tuple[int, ...]
    scale: torch.Tensor | None = None

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedTensor":
        """Rows (dim 0) or columns (dim 1) start .. start + length of the
        logical matrix, still as stored: a tensor-parallel rank's part, cut
        the way the parallel layers cut a dense tensor. GGUF: any rows,
        columns on the type's block boundaries; fp8: on the 128-wide scale
        blocks (a ragged last block may end the range; a dimension of one
        block keeps its one scale). Raises ValueError naming the numbers."""
        if len(self.shape) != 2 or dim not in (0, 1) or start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"{self.fmt} {list(self.shape)}: cannot take {start}..{start + length} of dim {dim}")
        if start == 0 and length == self.shape[dim]:
            return self
        shape = tuple(length if d == dim else n for d, n in enumerate(self.shape))
        side = "rows" if dim == 0 else "columns"
        if self.fmt == "fp8":
            full, blk = self.shape[dim], fp8_block.BLOCK
            if full <= blk:                 # one scale block spans the whole dimension
                return QuantizedTensor(self.fmt, self.data.narrow(dim, start, length), shape, self.scale)
            if start % blk or (length % blk and start + length != full):
                raise ValueError(f"fp8 {list(self.shape)}: {side} {start}..{start + length} do not fall on the "
                                 f"{blk}-wide scale blocks")
            return QuantizedTensor(self.fmt, self.data.narrow(dim, start, length), shape,
                                   self.scale.narrow(dim, start // blk, -(-length // blk)))
        t = gguf.QTYPES.get(self.fmt)
        if t is None:
            raise ValueError(f"{self.fmt} tensors cannot be cut ({side} {start}..{start + length})")
        if dim == 0:
            return QuantizedTensor(self.fmt, self.data.narrow(0, start, length), shape)
        if start % t.block or length % t.block:
            raise ValueError(f"GGUF {self.fmt} {list(self.shape)}: columns {start}..{start + length} do not fall "
                             f"on its {t.block}-element blocks")
        return QuantizedTensor(self.fmt, self.data.narrow(1, start // t.block * t.type_size,
                                                          length // t.block * t.type_size), shape)

    def zero_padded(self, rows: int) -> "QuantizedTensor":
        """The same rows followed by zero rows up to `rows` (the last rank's
        vocabulary padding): all-zero GGUF blocks dequantize to 0 in every
        type (every scale is 0)."""
        if self.fmt not in gguf.QTYPES or len(self.shape) != 2 or rows < self.shape[0]:
            raise ValueError(f"{self.fmt} {list(self.shape)}: cannot pad to {rows} rows")
        pad = self.data.new_zeros(rows - self.shape[0], self.data.shape[1])
        return QuantizedTensor(self.fmt, torch.cat([self.data, pad]), (rows, self.shape[1]))


def owned(t: torch.Tensor, device) -> torch.Tensor:
    """t on device, contiguous, in a storage of its own: a rank's part cut
    from a whole checkpoint tensor (a view, on the CPU) must not keep the
    whole tensor alive."""
    t = t.to(device).contiguous()
    if t.device.type != "meta" and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        t = t.clone()
    return t


class QuantMethod:
    name = "dense"
    shards_across_ranks = False    # can split its storage by tensor-parallel rank

    def matmul(self, layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight)

    def load(self, shard_id, offset: int, loaded, device: torch.device, dtype: torch.dtype) -> None:
        """Store checkpoint shard shard_id (a QuantizedTensor, or a dense
        tensor) at output row `offset`; methods that keep the layer's dense
        weight (Dense, Int4Cpu) never get here."""
        raise NotImplementedError

    def nbytes(self, layer) -> int:
        """Bytes of weight this layer holds (what is resident)."""
        w = layer.weight
        return w.numel() * w.element_size()


DENSE = QuantMethod()


class Int4Cpu(QuantMethod):
    name = "int4"

    def __init__(self, w):
        self.w = w          # parallel.int4.Int4Weight

    def matmul(self, layer, x):
        return int4_linear(x, self.w)

    def nbytes(self, layer):
        return self.w.nbytes


_SCRATCH: dict[tuple, torch.Tensor] = {}


# Weight elements a CPU GGUF layer dequantizes per matmul (4 MiB of fp32):
# Gemma3 decodes 32 rows as fast as with whole layers (within a 2-core EPYC's
# run-to-run noise), and the shared buffer stays 4 MiB, not the 640 MiB of
# Gemma3's 262k x 640 head.
TILE_ELEMENTS = 1 << 20


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One buffer per (dtype, device), grown to the largest layer: where CPU
    layers dequantize their weight just before their matmul."""
    key = (dtype, device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor even when first made under inference mode (the
        # engine): one made there could not be written outside it.
        with torch.inference_mode(False):
            buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


@dataclass
class Shard:
    offset: int                       # first output row of the layer's weight
    rows: int
    fmt: str | None                   # GGUF type, or None: dense rows
    data: torch.Tensor | None = None  # uint8 [rows, row_bytes], or float [rows, cols]


class GGUFBlocks(QuantMethod):
    """Per shard of the layer, its GGUF rows (or dense rows for a shard the
    file stores in another type)."""
    name = "gguf"
    shards_across_ranks = True      # the layer hands it its rank's rows / block-aligned columns

    def __init__(self, out_features: int, in_features: int):
        self.n, self.k = out_features, in_features
        self.shards: dict[object, Shard] = {}
        self._gemv: list | None = None     # _gemv_args(), built at the first decode

    def load(self, shard_id, offset: int, loaded, device, dtype) -> None:
        if isinstance(loaded, QuantizedTensor):
            rows, cols = loaded.shape
            data, fmt = loaded.data, loaded.fmt
        else:
            (rows, cols), fmt, data = loaded.shape, None, loaded.to(dtype)
        if cols != self.k or offset + rows > self.n:
            raise ValueError(f"shape mismatch: rows {offset}..{offset + rows} x {cols} do not fit "
                             f"[{self.n}, {self.k}]")
        if fmt and tuple(data.shape) != (rows, gguf.row_bytes(fmt, cols)):
            raise ValueError(f"{fmt} rows of {cols}: expected {rows} x {gguf.row_bytes(fmt, cols)} bytes, "
                             f"got {tuple(data.shape)}")
        self.shards[shard_id] = Shard(offset, rows, fmt, owned(data, device))
        self._gemv = None
        # Kept in row order, so a forward walks them as they are.
        self.shards = dict(sorted(self.shards.items(), key=lambda kv: kv[1].offset))
        if sum(s.rows for s in self.shards.values()) == self.n:
            self._coalesce()

    def _coalesce(self) -> None:
        """Once every row is loaded: neighbouring shards in the same GGUF type
        become one (q, k, v of one type: one GEMV call per step, not three)."""
        runs: list[list] = []
        for key, s in self.shards.items():
            if runs and s.fmt and runs[-1][-1][1].fmt == s.fmt:
                runs[-1].append((key, s))
            else:
                runs.append([(key, s)])
        self.shards = {
            run[0][0] if len(run) == 1 else tuple(k for k, _ in run):
                run[0][1] if len(run) == 1 else
                Shard(run[0][1].offset, sum(s.rows for _, s in run), run[0][1].fmt,
                      torch.cat([s.data for _, s in run]))
            for run in runs}

    def matmul(self, layer, x):
        shards = self.shards.values()
        if x.is_cuda:
            return torch.cat([gguf.matmul(x, s.data, s.fmt, self.k) if s.fmt else F.linear(x, s.data.to(x.dtype))
                              for s in shards], dim=-1)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.k)
        m = x2.shape[0]
        y = torch.empty(m, self.n, dtype=x.dtype)
        # Few rows (decode): the compiled fused GEMV, for a shard of up to its
        # type's gguf_cpu.gemv_max_m rows; more rows, dense rows or no kernel:
        # dequantized tiles and a matmul. Each shard into its columns of y.
        # ~120 calls per decode step: the per-shard arguments are built once.
        gemv = m > 0 and x.is_cpu and gguf_cpu.reason(x.dtype) is None
        for s, g, max_m in self._gemv or self._gemv_args():
            out = y if s.rows == self.n else y[:, s.offset:s.offset + s.rows]
            if gemv and m <= max_m:
                gguf_cpu.gemv_checked(x2, s.data, g, self.k, out)
            else:
                self._tiles(x2, s, out)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.n)

    def _tiles(self, x2, s: Shard, out) -> None:
        """out = x2 @ shard^T, TILE_ELEMENTS of the weight at a time dequantized
        (compiled kernel when built, else the torch reference) into the shared
        buffer, each tile multiplied into its columns."""
        step = max(1, TILE_ELEMENTS // self.k)
        w = scratch(min(step, s.rows) * self.k, x2.dtype, x2.device).view(-1, self.k)
        for a in range(0, s.rows, step):
            b = min(a + step, s.rows)
            if s.fmt:
                tile = gguf.dequantize(s.data[a:b], s.fmt, self.k, x2.dtype, out=w[:b - a])
            else:
                tile = s.data[a:b].to(x2.dtype)
            torch.mm(x2, tile.t(), out=out[:, a:b])

    def _gemv_args(self) -> list:
        """[(shard, ggml type id, most rows for the GEMV: 0 for dense rows)]."""
        self._gemv = [(s, gguf_cpu.type_id(s.fmt), gguf_cpu.gemv_max_m(s.fmt)) if s.fmt else (s, None, 0)
                      for s in self.shards.values()]
        return self._gemv

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized (an embedding held as GGUF blocks)."""
        (s,) = self.shards.values()
        rows = s.data[ids.reshape(-1)]
        out = gguf.dequantize(rows, s.fmt, self.k, dtype) if s.fmt else rows.to(dtype)
        return out.view(*ids.shape, self.k)

    def nbytes(self, layer):
        return sum(s.data.numel() * s.data.element_size() for s in self.shards.values())


class GGUFExperts(QuantMethod):
    """A MoE layer's routed experts kept as GGUF blocks: parts "gate", "up"
    (rows [E, I, row_bytes(H)]) and "down" ([E, H, row_bytes(I)]), this
    rank's E of them (experts first .. first + E of the file's stack)."""
    name = "gguf"
    shards_across_ranks = True
    PARTS = ("gate", "up", "down")

    def __init__(self, qtypes: dict[str, str], num_local: int, first: int, hidden: int, inter: int):
        if set(qtypes) != set(self.PARTS):
            raise ValueError(f"GGUF experts need gate, up and down tensors, got {sorted(qtypes)}")
        self.qtypes, self.E, self.first, self.H, self.I = dict(qtypes), num_local, first, hidden, inter
        self.parts: dict[str, torch.Tensor] = {}

    def load(self, part: str, offset: int, loaded, device, dtype) -> None:
        rows, cols = (self.I, self.H) if part != "down" else (self.H, self.I)
        if not isinstance(loaded, QuantizedTensor) or loaded.fmt != self.qtypes[part]:
            what = loaded.fmt if isinstance(loaded, QuantizedTensor) else f"dense {loaded.dtype}"
            raise ValueError(f"these experts keep their {part} rows as GGUF {self.qtypes[part]}; got {what}")
        if len(loaded.shape) != 3 or tuple(loaded.shape[1:]) != (rows, cols) or loaded.shape[0] < self.first + self.E:
            raise ValueError(f"shape mismatch: expected [experts, {rows}, {cols}], got {tuple(loaded.shape)}")
        data = loaded.data.view(loaded.shape[0], rows, -1)[self.first:self.first + self.E]
        if data.shape[2] != gguf.row_bytes(loaded.fmt, cols):
            raise ValueError(f"{part}: {data.shape[2]} bytes per row, {loaded.fmt} [{cols}] needs "
                             f"{gguf.row_bytes(loaded.fmt, cols)}")
        self.parts[part] = owned(data, device)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, limit: float,
                act: str = "silu") -> torch.Tensor:
        p, q = self.parts, self.qtypes
        w13 = ((p["gate"], q["gate"]), (p["up"], q["up"]), self.H)
        return moe.moe_forward(x, idx, w, w13, ((p["down"], q["down"]), self.I), "gguf", limit,
                               scratch=scratch(2 * self.I * self.H, x.dtype, x.device), act=act)

    def nbytes(self, layer):
        return sum(t.numel() * t.element_size() for t in self.parts.values())
