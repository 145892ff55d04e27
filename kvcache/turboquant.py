"""TurboQuant codec: random-sign + Walsh-Hadamard rotation, Lloyd-Max codebooks
for a Gaussian coordinate, exact bit packing, and an int8 per-vector format.

Every format here stores vectors in the *rotated* domain: y = R x with
R = H diag(s) / sqrt(D) (H the Walsh-Hadamard matrix, s random signs). R is
orthogonal, so q.k = (Rq).(Rk): attention rotates the query once and never
de-rotates keys; values are summed rotated and de-rotated once per query head.

TurboQuant (b bits, norm group g = head_dim or a sub-block of 32/64):
  per group of g rotated coordinates y_g: codes = nearest Lloyd-Max centroid of
  y_g / |y_g| (centroids of N(0,1) scaled by 1/sqrt(g)), and one fp16 scale
  |y_g| / |centroid vector| (norm correction: the reconstruction keeps the true
  length).
int8: y / (max|y| / 127) rounded, one fp16 scale per vector.
f16: y as fp16 (a component kept 16-bit inside a mixed-format layer).
"""
from dataclasses import dataclass
from functools import lru_cache
import math

import torch

LLOYD_MAX_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03455, 4: 0.00950}


# -- Lloyd-Max ----------------------------------------------------------------
def _phi(x):
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x):
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2)))


@lru_cache(maxsize=None)
def lloyd_max(bits: int, iters: int = 2000) -> tuple[tuple[float, ...], float]:
    """Centroids (ascending) of the MSE-optimal 2**bits-level quantizer for
    N(0, 1), computed by Lloyd's iteration on the exact Gaussian density, and
    its MSE (closed form: E[x^2] - sum_i P_i c_i^2 at the fixed point)."""
    n = 1 << bits
    # Start from the Gaussian quantiles' midpoints.
    c = [math.sqrt(2) * _erfinv(2 * (i + 0.5) / n - 1) for i in range(n)]
    for _ in range(iters):
        t = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [math.inf]
        new = []
        for i in range(n):
            a, b = t[i], t[i + 1]
            p = _Phi(b) - _Phi(a)
            # E[x | a < x < b] = (phi(a) - phi(b)) / p
            new.append(((_phi(a) if a != -math.inf else 0.0) - (_phi(b) if b != math.inf else 0.0)) / p)
        done = max(abs(x - y) for x, y in zip(c, new)) < 1e-13
        c = new
        if done:
            break
    t = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [math.inf]
    mse = 1.0 - sum((_Phi(t[i + 1]) - _Phi(t[i])) * c[i] ** 2 for i in range(n))
    return tuple(c), mse


def _erfinv(y: float) -> float:
    return float(torch.erfinv(torch.tensor(y, dtype=torch.float64)))


@lru_cache(maxsize=None)
def sphere_lloyd_max(bits: int, dim: int, grid: int = 1 << 18) -> tuple[tuple[float, ...], float]:
    """Lloyd-Max quantizer for one coordinate of a uniformly random unit vector
    in `dim` dimensions, the exact law of a rotated unit vector's coordinates
    (density proportional to (1 - x^2)^((dim - 3) / 2) on (-1, 1)); it tends to
    N(0, 1/dim) as dim grows but has lighter tails at 32-64 dims, where the
    Gaussian codebook wastes its outer levels (SmolLM2 k4v4 with centred keys:
    PPL +3.8% -> +3.3%, tests/bench/results/kv_levers_smollm2-135m.md).
    Centroids and MSE are in units of 1/sqrt(dim), comparable to
    lloyd_max(bits). Solved on a fine grid (prefix sums make each Lloyd step
    O(levels)), starting from the Gaussian solution."""
    r = math.sqrt(dim)
    z = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid * 2 * r - r
    w = (1 - z * z / dim).clamp_min(0) ** ((dim - 3) / 2)
    w = w / w.sum()
    cw = torch.cat([torch.zeros(1, dtype=torch.float64), w.cumsum(0)])
    cx = torch.cat([torch.zeros(1, dtype=torch.float64), (w * z).cumsum(0)])
    c = torch.tensor(lloyd_max(bits)[0], dtype=torch.float64)
    for _ in range(500):
        cut = torch.searchsorted(z, (c[1:] + c[:-1]) / 2)
        edges = torch.cat([torch.zeros(1, dtype=torch.long), cut, torch.tensor([grid])])
        mass = cw[edges[1:]] - cw[edges[:-1]]
        new = (cx[edges[1:]] - cx[edges[:-1]]) / mass
        done = float((new - c).abs().max()) < 1e-12
        c = new
        if done:
            break
    mse = float((w * z * z).sum() - (mass * c * c).sum())
    return tuple(c.tolist()), mse


@lru_cache(maxsize=None)
def _codebook(bits: int, group: int) -> torch.Tensor:
    c, _ = sphere_lloyd_max(bits, group)
    return torch.tensor(c, dtype=torch.float32) / math.sqrt(group)


def codebook_mse(bits: int, group: int) -> float:
    """Per-coordinate MSE (unit-variance units) the codebook attains on
    uniformly random unit vectors of `group` dims."""
    return sphere_lloyd_max(bits, group)[1]


# -- rotation -----------------------------------------------------------------
def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dim (a power of two)."""
    D = x.shape[-1]
    assert D & (D - 1) == 0, f"head_dim {D} is not a power of two"
    shape = x.shape
    y = x.reshape(-1, D)
    h = 1
    while h < D:
        y = y.view(-1, D // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape) * (D ** -0.5)


@lru_cache(maxsize=None)
def rotation_signs(head_dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (head_dim,), generator=g) * 2 - 1).float()


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R x = H (s * x) / sqrt(D)."""
    return fwht(x * signs.to(x.dtype))


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R^T y = s * (H y) / sqrt(D) (H is symmetric)."""
    return fwht(y) * signs.to(y.dtype)


def rotation_t(signs: torch.Tensor) -> torch.Tensor:
    """R^T as a float32 [D, D] matrix: x @ R^T = rotate(x), y @ R = unrotate(y).
    One matmul replaces the butterflies' ~20 small ops, which dominate when a
    decode step writes or reads one token per layer."""
    return rotate(torch.eye(signs.numel(), dtype=torch.float32, device=signs.device), signs).contiguous()


# -- bit packing --------------------------------------------------------------
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] integer codes < 2**bits (n % 8 == 0) -> [..., n * bits // 8] uint8.

    Little-endian: code i of each group of 8 occupies bits [bits*i, bits*i + bits)
    of that group's `bits` bytes, so 8 codes of 3 bits fill exactly 3 bytes."""
    n = codes.shape[-1]
    assert n % 8 == 0
    if bits in (2, 4):   # whole codes per byte: a few uint8 ops
        c = codes.to(torch.uint8).view(*codes.shape[:-1], n * bits // 8, 8 // bits)
        out = c[..., 0].clone()
        for j in range(1, 8 // bits):
            out |= c[..., j] << (bits * j)
        return out
    c = codes.to(torch.int64).view(*codes.shape[:-1], n // 8, 8)
    val = (c << (bits * torch.arange(8, device=codes.device))).sum(-1, keepdim=True)
    out = (val >> (8 * torch.arange(bits, device=codes.device))) & 255
    return out.to(torch.uint8).view(*codes.shape[:-1], n * bits // 8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits -> [..., n] long codes."""
    lead = packed.shape[:-1]
    if bits in (2, 4):   # whole codes per byte: shifts on uint8, no widening
        sh = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed.unsqueeze(-1) >> sh) & ((1 << bits) - 1)).view(*lead, n).long()
    wide = torch.int32 if bits <= 3 else torch.int64     # 8 codes = a 24-bit word fits int32
    p = packed.view(*lead, n // 8, bits).to(wide)
    val = (p << (8 * torch.arange(bits, dtype=wide, device=packed.device))).sum(-1, keepdim=True)
    sh = bits * torch.arange(8, dtype=wide, device=packed.device)
    return ((val >> sh) & ((1 << bits) - 1)).view(*lead, n).long()


# -- formats ------------------------------------------------------------------
@dataclass(frozen=True)
class ComponentFormat:
    """How one of K or V is stored: kind 'f16' | 'int8' | 'tq' (bits 2-5, norm group)."""
    kind: str
    bits: int = 16
    group: int | None = None     # tq: values per norm (None = the whole head)

    @property
    def name(self) -> str:
        if self.kind == "f16":
            return "f16"
        if self.kind == "int8":
            return "q8"
        return f"tq{self.bits}" + (f"g{self.group}" if self.group else "")


F16 = ComponentFormat("f16")
INT8 = ComponentFormat("int8", 8)


def tq(bits: int, group: int | None = None) -> ComponentFormat:
    if bits not in (2, 3, 4, 5):
        raise ValueError(f"TurboQuant bits must be 2, 3, 4 or 5, got {bits}")
    return ComponentFormat("tq", bits, group)


class Codec:
    """Encode/decode one component (K or V) of one layer, in the rotated domain.

    Storage is a dict of tensors whose first dim is the slot; `alloc` makes
    it, `encode` returns the per-token rows to index_copy_ into it, and
    `decode` turns gathered rows back into rotated float vectors.
    """

    def __init__(self, fmt: ComponentFormat, num_kv_heads: int, head_dim: int, seed: int):
        self.fmt, self.H, self.D = fmt, num_kv_heads, head_dim
        self.signs = rotation_signs(head_dim, seed)
        if fmt.kind == "tq":
            self.group = min(fmt.group or head_dim, head_dim)
            assert head_dim % self.group == 0 and head_dim * fmt.bits % 8 == 0
            self.codebook = _codebook(fmt.bits, self.group)
            self.bounds = (self.codebook[1:] + self.codebook[:-1]) / 2
        self._cache = {}   # device -> R^T; (device, dtype) -> rot_pm1; (name, device, dtype) -> on()

    def rot_t(self, device) -> torch.Tensor:
        r = self._cache.get(str(device))
        if r is None:
            r = self._cache[str(device)] = rotation_t(self.signs.to(device))
        return r

    def on(self, name: str, device, dtype=torch.float32) -> torch.Tensor:
        """The codebook or its bounds on device, copied once: a copy from host
        memory in every call would also break CUDA-graph capture."""
        key = (name, str(device), dtype)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = getattr(self, name).to(device=device, dtype=dtype)
        return t

    def rot_pm1(self, device, dtype) -> torch.Tensor:
        """diag(signs) @ H unnormalised, [D, D] in dtype: entries +-1, exact
        in any dtype, so a 16-bit kernel can rotate with it (x @ it / sqrt(D)
        = rotate(x)) without rounding the rotation itself."""
        key = (str(device), dtype)
        r = self._cache.get(key)
        if r is None:
            r = self._cache[key] = (self.rot_t(device) * self.D ** 0.5).round().to(dtype).contiguous()
        return r

    def alloc(self, num_slots: int, device) -> dict[str, torch.Tensor]:
        H, D, f = self.H, self.D, self.fmt
        if f.kind == "f16":
            return {"x": torch.zeros(num_slots, H, D, dtype=torch.float16, device=device)}
        if f.kind == "int8":
            return {"q": torch.zeros(num_slots, H, D, dtype=torch.int8, device=device),
                    "scale": torch.zeros(num_slots, H, 1, dtype=torch.float16, device=device)}
        return {"codes": torch.zeros(num_slots, H, D * f.bits // 8, dtype=torch.uint8, device=device),
                "scale": torch.zeros(num_slots, H, D // self.group, dtype=torch.float16, device=device)}

    def quantize_rotated(self, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """y: [T, H, D] rotated float vectors -> storage rows."""
        f = self.fmt
        if f.kind == "f16":
            return {"x": y.to(torch.float16)}
        if f.kind == "int8":
            s = y.abs().amax(-1, keepdim=True).float() / 127
            q = torch.where(s > 0, y / s, torch.zeros_like(y)).round().clamp(-127, 127)
            return {"q": q.to(torch.int8), "scale": s.to(torch.float16)}
        T, H, D = y.shape
        g = y.float().view(T, H, D // self.group, self.group)
        norm = g.norm(dim=-1, keepdim=True)
        u = g / norm.clamp_min(1e-30)
        codes = torch.bucketize(u, self.on("bounds", y.device))
        rec = self.on("codebook", y.device)[codes]
        scale = norm / rec.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        return {"codes": pack_bits(codes.view(T, H, D), f.bits),
                "scale": scale.view(T, H, D // self.group).to(torch.float16)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x: [T, H, D] (unrotated) -> storage rows."""
        return self.quantize_rotated(x.float() @ self.rot_t(x.device))

    def decode(self, rows: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
        """Storage rows [..., H, *] -> rotated vectors [..., H, D]."""
        f = self.fmt
        if f.kind == "f16":
            return rows["x"].to(dtype)
        if f.kind == "int8":
            return rows["q"].to(dtype) * rows["scale"].to(dtype)
        codes = unpack_bits(rows["codes"], f.bits, self.D)
        lead = codes.shape[:-1]
        c = self.on("codebook", codes.device, dtype).index_select(0, codes.flatten())
        c = c.view(*lead, self.D)
        c = c.view(*lead, self.D // self.group, self.group) * rows["scale"].to(dtype).unsqueeze(-1)
        return c.view(*lead, self.D)

    def dequantize(self, rows: dict[str, torch.Tensor], dtype=torch.float32) -> torch.Tensor:
        """Storage rows -> vectors in the original (unrotated) domain."""
        y = self.decode(rows, torch.float32)
        return (y @ self.rot_t(y.device).T).to(dtype)

    def bits_per_value(self) -> float:
        rows = self.alloc(1, "cpu")
        return sum(t.numel() * t.element_size() for t in rows.values()) * 8 / (self.H * self.D)


def unit_mse(y: torch.Tensor, bits: int, group: int | None = None) -> float:
    """Per-coordinate MSE (relative to a unit-variance coordinate) of quantizing
    the unit vectors of rotated vectors y [N, D] (per norm group) with the
    Lloyd-Max codebook, before norm correction: comparable to codebook_mse."""
    D = y.shape[-1]
    g = group or D
    u = y.float().reshape(-1, g)
    u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    cb = _codebook(bits, g)
    codes = torch.bucketize(u, (cb[1:] + cb[:-1]) / 2)
    return float(((u - cb[codes]) ** 2).mean() * g)
