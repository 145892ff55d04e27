"""FP8 (128x128 block scales) and MXFP4 (e2m1 + E8M0 per 32) weights kept as
stored, behind `--quantization fp8` (DeepSeek-V4's checkpoints):

- Fp8Block: a linear layer's float8_e4m3fn rows + their block scales
  (parallel.quant.fp8_block.matmul: CPU dequantizes into the one scratch
  buffer shared by all layers, then F.linear; CUDA runs the Triton kernels).
  Tensor parallelism: a column-parallel layer keeps its rank's rows, a
  row-parallel one its rank's columns, with the matching scale rows /
  columns (the layer cuts them: QuantizedTensor.narrow); the split must fall
  on the 128-wide scale blocks (or the whole dimension be one block), else
  a ValueError names the numbers when the method is made.
- ExpertWeights: the routed experts of one MoE layer, [E, 2I, ...] (gate
  then up rows) and [E, H, ...] with their scales, in format "mxfp4" or
  "fp8", run by parallel.quant.moe.moe_forward (one grouped path for the
  batch). Tensor parallelism splits by expert id (whole experts per rank),
  so each rank just keeps its own experts.

Both take checkpoint tensors as parallel.quant.base.QuantizedTensor and
report what they hold in nbytes (model_zoo.models.resident_bytes)."""
from __future__ import annotations

import torch

from parallel.quant import fp8_block, moe, mxfp4
from parallel.quant.base import QuantizedTensor, QuantMethod, owned, scratch

BLOCK = fp8_block.BLOCK
GROUP = mxfp4.GROUP
# None: Triton on CUDA, torch elsewhere; "torch" / "triton" forces one (tests: "triton" under TRITON_INTERPRET).
BACKEND: str | None = None

_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor | None:
    """Raw E8M0 bytes of an E8M0 scale (uint8 or float8_e8m0fnu), None for float scales."""
    if scale.dtype == torch.uint8:
        return scale
    if _E8M0 is not None and scale.dtype == _E8M0:
        return scale.view(torch.uint8)
    return None


class Fp8Block(QuantMethod):
    """A linear layer's FP8 weight as stored: w8 [n, k] float8_e4m3fn and
    scale [ceil(n/128), ceil(k/128)] (fp32, or E8M0 bytes), this rank's part.
    split: None (the whole matrix: replicated layer), 0 (rows: column-parallel),
    1 (columns: row-parallel), of `size` parts of which this rank holds `rank`."""
    name = "fp8"

    def __init__(self, out_features: int, in_features: int, split: int | None = None, rank: int = 0,
                 size: int = 1, what: str = "layer"):
        self.n, self.k = out_features, in_features
        self.split, self.rank, self.size = (split, rank, size) if size > 1 else (None, 0, 1)
        self.shards_across_ranks = True      # every split it accepts is a block-aligned slice
        self.w8: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        if self.split is not None:
            local = (self.n, self.k)[self.split]
            full = local * size
            if local % BLOCK and full > BLOCK:
                side = "output rows" if self.split == 0 else "input columns"
                raise ValueError(f"fp8 {what}: {full} {side} split over {size} tensor-parallel ranks are {local} "
                                 f"per rank, not a multiple of the {BLOCK}-wide scale blocks")

    @classmethod
    def for_layer(cls, layer, what: str = "layer") -> "Fp8Block":
        """The method for a parallel.linear layer (built on the meta device, still holding its dense weight)."""
        from parallel.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
        if isinstance(layer, QKVParallelLinear) or hasattr(layer, "output_sizes"):
            raise ValueError(f"fp8 {what}: fused layers (q/k/v, gate/up) cannot keep FP8 weights yet")
        n, k = layer.weight.shape
        split = 0 if isinstance(layer, ColumnParallelLinear) else 1 if isinstance(layer, RowParallelLinear) else None
        return cls(n, k, split, layer.tp_rank, layer.tp_size, what)

    @property
    def full_shape(self) -> tuple[int, int]:
        if self.split == 0:
            return self.n * self.size, self.k
        if self.split == 1:
            return self.n, self.k * self.size
        return self.n, self.k

    def load(self, shard_id, offset, loaded, device, dtype) -> None:
        """loaded: this rank's part, cut by the layer (QuantizedTensor.narrow)."""
        if shard_id is not None or offset:
            raise ValueError(f"fp8: fused layers (shard {shard_id!r}) are not supported")
        if not isinstance(loaded, QuantizedTensor) or loaded.fmt != "fp8":
            what = f"a {loaded.fmt} tensor" if isinstance(loaded, QuantizedTensor) else f"a dense {loaded.dtype} tensor"
            raise ValueError(f"this layer keeps FP8 weights as stored; the checkpoint gives {what}")
        w8, s = loaded.data, loaded.scale
        if tuple(w8.shape) != (self.n, self.k) or tuple(s.shape) != (_blocks(self.n), _blocks(self.k)):
            raise ValueError(f"shape mismatch: expected fp8 [{self.n}, {self.k}] with scales "
                             f"[{_blocks(self.n)}, {_blocks(self.k)}], got {tuple(w8.shape)} with scales "
                             f"{tuple(s.shape)}")
        self.w8, self.scale = owned(w8, device), owned(s, device)

    def _backend(self, x: torch.Tensor) -> str:
        return fp8_block.pick_backend(BACKEND, x)

    def matmul(self, layer, x):
        if self._backend(x) == "triton":
            return fp8_block.matmul(x, self.w8, self.scale, backend="triton")
        return fp8_block.matmul(x, self.w8, self.scale, scratch(self.n * self.k, x.dtype, x.device), backend="torch")

    def dequantized(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The dense [n, k] weight, in the shared scratch buffer (valid until the next layer uses it)."""
        return fp8_block.dequantize(self.w8, self.scale, dtype, out=scratch(self.n * self.k, dtype, device))

    def grouped_matmul(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """x [T, G, k] times the G row groups of the weight (group g: rows
        g*n/G ... (g+1)*n/G) -> [T, G, n/G]: DeepSeek-V4's grouped o_a_proj."""
        per = self.n // groups
        if self._backend(x) == "triton" and per % BLOCK == 0:
            sb = per // BLOCK
            return torch.stack([fp8_block.matmul(x[:, g], self.w8[g * per:(g + 1) * per],
                                                 self.scale[g * sb:(g + 1) * sb], backend="triton")
                                for g in range(groups)], dim=1)
        w = self.dequantized(x.dtype, x.device).view(groups, per, self.k)
        return torch.einsum("tgi,goi->tgo", x, w)

    def nbytes(self, layer):
        return _nbytes(self.w8, self.scale)


class ExpertWeights(QuantMethod):
    """One MoE layer's routed experts as stored, this rank's `num_local`:
    fmt "mxfp4": w13 = (codes uint8 [E, 2I, H/2], scales [E, 2I, H/32]), w2 = ([E, H, I/2], [E, H, I/32]);
    fmt "fp8":   w13 = (float8_e4m3fn [E, 2I, H], scales [E, 2I/128, ceil(H/128)]), w2 likewise
                 (I a multiple of 128, so gate and up rows never share a scale block).
    Scales are kept as E8M0 bytes (uint8) when the checkpoint's are E8M0, else fp32.
    Storage is allocated at the first loaded expert (its scale dtype decides)."""

    def __init__(self, fmt: str, num_local: int, hidden: int, inter: int):
        why = self.unsupported(fmt, hidden, inter)
        if why:
            raise ValueError(why)
        self.name = self.fmt = fmt
        self.shards_across_ranks = True
        self.E, self.H, self.I = num_local, hidden, inter
        self.w13: tuple[torch.Tensor, torch.Tensor] | None = None
        self.w2: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def unsupported(fmt: str, hidden: int, inter: int) -> str | None:
        """Why experts of these sizes cannot be held in fmt, or None."""
        if fmt not in ("mxfp4", "fp8"):
            return f"experts: stored format {fmt!r} is not supported (mxfp4, fp8)"
        if fmt == "mxfp4" and (hidden % GROUP or inter % GROUP):
            return f"mxfp4 experts: hidden {hidden} and intermediate {inter} must be multiples of {GROUP}"
        if fmt == "fp8" and inter % BLOCK:
            return f"fp8 experts: intermediate size {inter} must be a multiple of {BLOCK}"
        return None

    def _shapes(self, rows: int, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self.fmt == "mxfp4":
            return (self.E, rows, cols // 2), (self.E, rows, cols // GROUP)
        return (self.E, rows, cols), (self.E, _blocks(rows), _blocks(cols))

    def _allocate(self, scale: torch.Tensor, device) -> None:
        sdtype = torch.uint8 if _e8m0_bytes(scale) is not None else torch.float32
        ddtype = torch.uint8 if self.fmt == "mxfp4" else torch.float8_e4m3fn
        out = []
        for rows, cols in ((2 * self.I, self.H), (self.H, self.I)):
            d, s = self._shapes(rows, cols)
            out.append((torch.zeros(d, dtype=ddtype, device=device), torch.zeros(s, dtype=sdtype, device=device)))
        self.w13, self.w2 = out

    def load(self, shard_id, offset, loaded, device, dtype) -> None:
        """shard_id (local expert, "w13" | "w2"); offset: first row in w13 (0: gate, I: up)."""
        e, which = shard_id
        if not isinstance(loaded, QuantizedTensor) or loaded.fmt != self.fmt:
            what = f"{loaded.fmt}" if isinstance(loaded, QuantizedTensor) else f"dense {loaded.dtype}"
            raise ValueError(f"these experts keep {self.fmt} weights as stored; the checkpoint gives {what}")
        rows, cols = (self.I, self.H) if which == "w13" else (self.H, self.I)
        d, s = self._shapes(rows, cols)
        data = loaded.data if loaded.data.dtype in (torch.uint8, torch.float8_e4m3fn) else loaded.data.view(torch.uint8)
        if tuple(loaded.shape) != (rows, cols) or tuple(data.shape) != d[1:] or tuple(loaded.scale.shape) != s[1:]:
            raise ValueError(f"shape mismatch: expected {self.fmt} [{rows}, {cols}] (data {d[1:]}, scales {s[1:]}), "
                             f"got {tuple(loaded.shape)} (data {tuple(data.shape)}, "
                             f"scales {tuple(loaded.scale.shape)})")
        if self.w13 is None:
            self._allocate(loaded.scale, device)
        dst_d, dst_s = self.w13 if which == "w13" else self.w2
        if dst_s.dtype == torch.uint8:
            scale = _e8m0_bytes(loaded.scale)
            if scale is None:
                raise ValueError(f"expert {e}: float scales where the layer's other experts have E8M0 ones")
        else:
            scale = fp8_block.scale_f32(loaded.scale)
        r0 = offset if self.fmt == "mxfp4" else offset // BLOCK
        dst_d[e, offset:offset + rows].copy_(data)
        dst_s[e, r0:r0 + s[1]].copy_(scale)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, limit: float,
                act: str = "silu") -> torch.Tensor:
        """x [T, H], idx [T, k] local expert ids (off this rank: outside [0, E)), w [T, k] routing weights."""
        buf = None
        if fp8_block.pick_backend(BACKEND, x) == "torch":
            buf = scratch(2 * self.I * self.H, x.dtype, x.device)
        return moe.moe_forward(x, idx, w, self.w13, self.w2, self.fmt, limit, scratch=buf, backend=BACKEND, act=act)

    def nbytes(self, layer):
        return _nbytes(*(self.w13 or ()), *(self.w2 or ()))
