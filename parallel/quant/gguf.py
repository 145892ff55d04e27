"""GGUF quantized blocks kept as stored, dequantized on the fly.

A weight W [N, k] stays as the GGUF file holds it: uint8 [N, row_bytes], one
row of k // block blocks per output feature. `dequantize` rebuilds W (torch,
vectorised, any device: bit-exact against gguf-py's numpy dequantizer in
fp32, same operations in the same order); `matmul` computes x @ W^T: on CUDA
with the Triton kernels of gguf_triton.py (dequantisation in registers, no
[N, k] temporary); on CPU with the compiled kernels of gguf_cpu.py (a fused
GEMV for a few rows of x, else dequantisation into a reusable buffer, then
F.linear), or the torch reference where they are unavailable.

Block layouts (llama.cpp ggml-common.h; gguf-py's gguf.quants reads them the
same way). fp16 scalars little-endian; "q[i]" is element i of the block;
nibble tables put elements 0..15 (resp. a 32-run) in the low nibbles and the
next 16 (32) in the high nibbles of the same bytes.

  Q8_0  32 / 34 B: d f16 | qs int8[32]                 w = d * q
  Q4_0  32 / 18 B: d f16 | qs[16] nibbles              w = d * (q - 8)
  Q4_1  32 / 20 B: d f16 | m f16 | qs[16] nibbles      w = d * q + m
  Q5_0  32 / 22 B: d f16 | qh u32 (bit i -> q[i] bit 4) | qs[16] nibbles
                                                       w = d * (q - 16)
  Q4_K 256 / 144 B: d f16 | dmin f16 | scales[12] | qs[128]
        8 sub-blocks of 32 with 6-bit scale sc_j and min m_j packed in
        scales[12] (j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4:
        sc = s[j+4] & 15 | (s[j-4] >> 6) << 4, m = s[j+4] >> 4 | (s[j] >> 6) << 4);
        byte 32c + l holds sub-block 2c (low nibble) and 2c+1 (high) at l.
                                                       w = (d*sc_j) * q - (dmin*m_j)
  Q5_K 256 / 176 B: d | dmin | scales[12] | qh[32] | qs[128]: as Q4_K, plus
        bit j of qh[l] = bit 4 of element l of sub-block j.
  Q6_K 256 / 210 B: ql[128] | qh[64] | scales int8[16] | d f16
        element 128h + r: low 4 bits from ql[64h + r % 64] (nibble r // 64),
        high 2 bits from qh[32h + r % 32] (bits 2*(r // 32)); 16 sub-blocks of 16
                                                       w = (d*sc_j) * (q - 32)

Q5_0 is not in the issue's list; it is here because the Gemma3 Q4_K_M file
stores attn_q/k/v, ffn_gate and ffn_up in it (81 of its 127 quantized
tensors).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFType:
    name: str
    ggml_type: int      # gguf.GGMLQuantizationType value
    block: int          # elements per block
    type_size: int      # bytes per block

    @property
    def bytes_per_param(self) -> float:
        return self.type_size / self.block


QTYPES: dict[str, GGUFType] = {t.name: t for t in (
    GGUFType("Q8_0", 8, 32, 34),
    GGUFType("Q4_0", 2, 32, 18),
    GGUFType("Q4_1", 3, 32, 20),
    GGUFType("Q5_0", 6, 32, 22),
    GGUFType("Q4_K", 12, 256, 144),
    GGUFType("Q5_K", 13, 256, 176),
    GGUFType("Q6_K", 14, 256, 210),
)}
_BY_GGML = {t.ggml_type: t.name for t in QTYPES.values()}

# Rows of more than GEMV_MAX_M go to the tl.dot kernel.
GEMV_MAX_M = 16
# Elements dequantized per torch pass: bounds dequantize's temporaries
# (a few times 16 MiB) whatever the matrix size.
_CHUNK = 1 << 22


def qtype_name(ggml_type) -> str | None:
    """The QTYPES name of a GGML type (int or gguf.GGMLQuantizationType), or
    None when these kernels do not take it."""
    try:
        return _BY_GGML.get(int(ggml_type))
    except (TypeError, ValueError):
        return None


def _type(qtype: str) -> GGUFType:
    t = QTYPES.get(qtype)
    if t is None:
        raise ValueError(f"unsupported GGUF type {qtype!r} (have {', '.join(QTYPES)})")
    return t


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k elements."""
    t = _type(qtype)
    if k <= 0 or k % t.block:
        raise ValueError(f"{qtype}: row length {k} is not a positive multiple of the block ({t.block})")
    return k // t.block * t.type_size


def _check_raw(raw: torch.Tensor, qtype: str, k: int) -> GGUFType:
    rb = row_bytes(qtype, k)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != rb:
        raise ValueError(f"{qtype} rows of {k}: expected uint8 [N, {rb}], got {raw.dtype} {tuple(raw.shape)}")
    return _type(qtype)


# -- torch dequantisation: blocks [R, nb, type_size] uint8 -> [R, nb, block] fp32 --
_CONST: dict = {}


def _u8(values: tuple, device) -> torch.Tensor:
    key = (values, str(device))
    if key not in _CONST:
        _CONST[key] = torch.tensor(values, dtype=torch.uint8, device=device)
    return _CONST[key]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian fp16 bytes -> [..., 1] fp32."""
    try:
        return b.view(torch.float16).float()
    except RuntimeError:            # odd offset or stride: copy first
        return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high nibbles."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q8_0(b):
    return _f16(b[..., :2]) * b[..., 2:].view(torch.int8).float()


def _q4_0(b):
    return _f16(b[..., :2]) * (_nibbles(b[..., 2:18]).to(torch.int8) - 8).float()


def _q4_1(b):
    return _f16(b[..., :2]) * _nibbles(b[..., 4:20]).float() + _f16(b[..., 2:4])


def _q5_0(b):
    bits = ((b[..., 2:6].unsqueeze(-1) >> _u8(tuple(range(8)), b.device)) & 1).flatten(-2)
    q = (_nibbles(b[..., 6:22]) | (bits << 4)).to(torch.int8) - 16
    return _f16(b[..., :2]) * q.float()


def _scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K scales[12] -> 8 six-bit scales and 8 six-bit mins (fp32)."""
    lo, hi, ex = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (ex & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (ex >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _k_low4(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K qs[128] -> [..., 8, 32]: sub-block 2c low nibbles of bytes 32c.., 2c+1 high."""
    qs = qs.unflatten(-1, (4, 32))
    return torch.stack([qs & 15, qs >> 4], dim=-2).flatten(-3, -2)


def _k_affine(b, q):
    sc, mn = _scale_min(b[..., 4:16])
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    w = (d * sc).unsqueeze(-1) * q.float() - (dmin * mn).unsqueeze(-1)
    return w.flatten(-2)


def _q4_k(b):
    return _k_affine(b, _k_low4(b[..., 16:144]))


def _q5_k(b):
    high = (b[..., 16:48].unsqueeze(-2) >> _u8(tuple(range(8)), b.device).view(8, 1)) & 1
    return _k_affine(b, _k_low4(b[..., 48:176]) | (high << 4))


def _q6_k(b):
    lead = b.shape[:-1]
    ql = (b[..., :128].reshape(*lead, 2, 1, 64) >> _u8((0, 4), b.device).view(2, 1)) & 15
    qh = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> _u8((0, 2, 4, 6), b.device).view(4, 1)) & 3
    q = (ql.reshape(*lead, 8, 32) | (qh.reshape(*lead, 8, 32) << 4)).to(torch.int8) - 32
    scale = _f16(b[..., 208:210]) * b[..., 192:208].view(torch.int8).float()
    return (scale.unsqueeze(-1) * q.reshape(*lead, 16, 16).float()).flatten(-2)


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


_FALLBACK_LOGGED: set = set()


def _cpu_kernel(dtype: torch.dtype):
    """gguf_cpu when its compiled kernel serves CPU tensors of dtype (built at
    first call), else None, logging why at the first fallback for each reason."""
    from parallel.quant import gguf_cpu
    why = gguf_cpu.reason(dtype)
    if why is None:
        return gguf_cpu
    kind = why.splitlines()[0]
    if kind not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(kind)
        log.warning("GGUF blocks on CPU: the torch reference path (slower) instead of the compiled kernel: %s",
                    why)
    return None


def dequantize(raw: torch.Tensor, qtype: str, k: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None, *, backend: str | None = None) -> torch.Tensor:
    """raw uint8 [N, row_bytes(qtype, k)] -> W [N, k] in dtype (written into
    `out`, an [N, k] tensor of that dtype, when given). Computed in fp32 (as
    gguf-py: bit-exact), then rounded once to dtype.

    backend None: "cpu" for CPU tensors when gguf_cpu's kernel serves dtype
    (fp32 / bf16, built), else "torch". "cpu": the compiled kernel (same
    values, bit for bit). "torch": the reference, whole row ranges at a time,
    _CHUNK elements per pass."""
    t = _check_raw(raw, qtype, k)
    n = raw.shape[0]
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=raw.device)
    elif tuple(out.shape) != (n, k) or out.dtype != dtype or out.device != raw.device:
        raise ValueError(f"out must be {dtype} [{n}, {k}] on {raw.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if backend is None:
        backend = "cpu" if raw.device.type == "cpu" and _cpu_kernel(dtype) is not None else "torch"
    if backend == "cpu":
        from parallel.quant import gguf_cpu
        if out.stride(1) == 1 and raw.stride(1) == 1:
            return gguf_cpu.dequantize_into(raw, qtype, k, out)
        tmp = gguf_cpu.dequantize_into(raw.contiguous(), qtype, k, torch.empty(n, k, dtype=dtype))
        return out.copy_(tmp)
    if backend != "torch":
        raise ValueError(f"backend must be 'cpu', 'torch' or None, got {backend!r}")
    fn, nb = _DEQUANT[qtype], k // t.block
    step = max(1, _CHUNK // k)
    for r0 in range(0, n, step):
        part = raw[r0:r0 + step]
        out[r0:r0 + part.shape[0]] = fn(part.reshape(part.shape[0], nb, t.type_size)).reshape(-1, k)
    return out


def _scratch_view(scratch, n, k, x):
    if scratch is None:
        return None
    if scratch.dtype != x.dtype or scratch.device != x.device or not scratch.is_contiguous() \
            or scratch.numel() < n * k:
        raise ValueError(f"scratch must be a contiguous {x.dtype} buffer of at least {n}x{k} elements "
                         f"on {x.device}, got {scratch.dtype} {tuple(scratch.shape)} on {scratch.device}")
    return scratch.view(-1)[:n * k].view(n, k)


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: str, k: int,
           scratch: torch.Tensor | None = None, *, backend: str | None = None) -> torch.Tensor:
    """y = x @ W^T for W stored as GGUF rows raw [N, row_bytes]: x [..., k] ->
    [..., N] in x.dtype.

    backend None: "triton" on CUDA; on CPU "cpu" when gguf_cpu's kernel
    serves x.dtype (fp32 / bf16, built), else "torch". "torch": W
    dequantized by the torch reference into `scratch` (an [N, k] buffer of
    x.dtype, or any contiguous one of at least N*k elements: its first N*k
    are used; allocated when None), then F.linear. "cpu": the same with the
    compiled dequantisation (same W, bit for bit), except that with no
    scratch given and at most gguf_cpu.gemv_max_m(qtype) rows of x it runs the
    fused GEMV (W never written out; fp32 accumulation in another order).
    "triton": the kernels of gguf_triton (M <= GEMV_MAX_M rows: GEMV-shaped,
    split along N and K; more: tl.dot tiles), fp32 accumulation; on CPU
    tensors only under TRITON_INTERPRET=1 (tests)."""
    t = _check_raw(raw, qtype, k)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    n = raw.shape[0]
    if backend is None:
        backend = "triton" if x.is_cuda else \
            "cpu" if x.device.type == "cpu" and raw.device.type == "cpu" and _cpu_kernel(x.dtype) is not None \
            else "torch"
    if backend == "cpu":
        from parallel.quant import gguf_cpu
        x2 = x.reshape(-1, k)
        if scratch is None and x2.shape[0] <= gguf_cpu.gemv_max_m(qtype):
            return gguf_cpu.gemv(x2, raw, qtype, k).view(*x.shape[:-1], n)
        w = dequantize(raw, qtype, k, x.dtype, out=_scratch_view(scratch, n, k, x), backend="cpu")
        return F.linear(x, w)
    if backend == "torch":
        w = dequantize(raw, qtype, k, x.dtype, out=_scratch_view(scratch, n, k, x), backend="torch")
        return F.linear(x, w)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton', 'cpu', 'torch' or None, got {backend!r}")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        raise RuntimeError("the Triton GGUF kernels need CUDA tensors (or TRITON_INTERPRET=1)")
    if raw.device != x.device:
        raise ValueError(f"x is on {x.device}, the weight on {raw.device}")
    from parallel.quant import gguf_triton
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    if x2.shape[0] <= GEMV_MAX_M:
        y = gguf_triton.gemv(x2, raw, t, k)
    else:
        y = gguf_triton.gemm(x2, raw, t, k)
    return y.view(*x.shape[:-1], n)
