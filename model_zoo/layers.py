"""Building blocks shared by the model files: norms, rotary embedding,
gated activations, and the checkpoint load loop.

Numerics follow transformers' modeling code exactly (which dtype each step
runs in), because logit parity with it is the model zoo's contract.
"""
import functools
import math
import re
import struct
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from model_zoo import cpu_ops
from model_zoo.fused_moe import EXPERT_PARTS


@functools.lru_cache(maxsize=64)
def rounded_to(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as a Python float: a constant factor as
    transformers applies it (a tensor of the weight dtype), without building
    a tensor in the forward (a host-to-device copy per step on a GPU, and an
    op a CUDA graph's capture refuses): IEEE rounding done on the bits."""
    f32 = struct.unpack("<f", struct.pack("<f", value))[0]
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", f32))[0]
    if dtype == torch.bfloat16:         # fp32's top 16 bits, rounded to nearest even
        bits = struct.unpack("<I", struct.pack("<f", f32))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    return f32


class CpuOp(nn.Module):
    """A layer with a compiled CPU form (model_zoo/cpu_ops.py) next to its
    torch form: forward_cpu for the tensors the kernels serve (CPU fp32 /
    bf16), forward_native, the reference, for everything else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_cpu(x) if cpu_ops.runs(x) else self.forward_native(x)


class RMSNorm(CpuOp):
    """Llama/Qwen RMSNorm: normalise in fp32, cast back, then scale by w."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def init_dummy(self, generator, low, high):
        self.weight.fill_(1.0)    # identity scale (models.init_dummy_weights)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != x.dtype:
            return self.forward_native(x)       # torch promotes w * x to the wider dtype
        return cpu_ops.rms_norm(x, self.weight, self.eps)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(CpuOp):
    """Gemma RMSNorm: scale by (1 + w), all in fp32, cast back at the end.

    The stored weight is the offset from 1 (HF checkpoints; GGUF stores w + 1).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def init_dummy(self, generator, low, high):
        self.weight.zero_()       # identity scale 1 + 0 (models.init_dummy_weights)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.rms_norm(x, self.weight, self.eps, gemma=True)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's final-logit soft-capping: cap * tanh(logits / cap) (None: as they are)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class SiluAndMul(CpuOp):
    """[..., 2n] (gate, up) -> silu(gate) * up."""

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.act_and_mul(x, cpu_ops.SILU)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(CpuOp):
    """[..., 2n] (gate, up) -> gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh)."""

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # fp32 is the parity mode: the kernel's tanh (from its own exp) differs from
            # torch's in the last bits, which a tiny random Gemma 4 amplified to 2.3e-4 in
            # its logits against transformers (bound 1e-4); torch's 3 ops cost ~5 us.
            return self.forward_native(x)
        return cpu_ops.act_and_mul(x, cpu_ops.GELU_TANH)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# ---------------------------------------------------------------- rotary

def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for one rope parameter dict
    (transformers' `rope_parameters` shape: rope_type, rope_theta, factor, ...).
    Always computed on the CPU (also under a meta-device build): the same values
    on every device."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = rope["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Scaling positions by 1/factor is the same as scaling frequencies.
        return inv_freq / rope["factor"]
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept,
        # a smooth blend in between.
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


def rope_parameters(config: dict, default_theta: float = 10000.0) -> dict:
    """The single rope dict of a llama-style config.json, old or new format.

    transformers 5 writes `rope_parameters`; older files have `rope_theta` and
    an optional `rope_scaling` dict next to it.
    """
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", default_theta))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return rope


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half over the whole head), as HF llama.

    cos/sin are computed from the positions, in fp32 like transformers, then
    cast to the activations' dtype: exact at any position without a table
    sized by max_position_embeddings. A model that calls begin(positions) at
    the start of its forward gets them computed once for all its layers.
    """

    def __init__(self, head_dim: int, rope: dict):
        super().__init__()
        self.head_dim = head_dim
        # A plain attribute, not a buffer, so model.to(bfloat16) cannot round
        # the frequencies; it follows the positions' device on first use.
        self.inv_freq = rope_inv_freq(head_dim, rope)
        self._step: torch.Tensor | None = None      # this forward's positions (begin)
        self._memo: tuple | None = None

    def init_constants(self, device) -> None:
        self.inv_freq = self.inv_freq.to(device)

    def begin(self, positions: torch.Tensor) -> None:
        """A forward over `positions` starts: its layers share one cos / sin."""
        self._step, self._memo = positions, None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, Hq*D], k [T, Hkv*D] -> rotated q, k (same shapes)."""
        memo = self._memo
        if memo is None or memo[0] is not positions or memo[1] != q.dtype:
            memo = (positions, q.dtype, *self._cos_sin(positions, q.dtype))
            if positions is self._step:
                self._memo = memo
        cos, sin = memo[2], memo[3]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _cos_sin(self, positions, dtype):
        """cos [T, 1, D] and sin with rotate_half's sign folded in ([-sin, sin])."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return (torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
                torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :])

    def _rotate(self, x, cos, sin):
        # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]: the same products, fewer ops.
        if cpu_ops.runs(x):
            return cpu_ops.rope(x, self.head_dim, cos, sin)
        T = x.shape[0]
        x = x.view(T, -1, self.head_dim)
        return (x * cos + x.roll(self.head_dim // 2, -1) * sin).view(T, -1)


# ---------------------------------------------------------------- loading

# HF q/k/v and gate/up projections -> our fused modules (and shard ids).
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# `<prefix>.experts.<e>.<proj>.weight`: one routed expert's tensor (model_zoo.fused_moe), or with
# no <e> all of them stacked (a GGUF file's ffn_*_exps, kept as blocks).
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?:(?P<e>\d+)\.)?(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def packed_target(hf_name: str, packed: dict[str, tuple[str, object]]) -> tuple[str, object]:
    """(our parameter name, shard id or None) of an HF tensor name."""
    module, _, leaf = hf_name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in packed:
        dst, shard = packed[last]
        return f"{parent}.{dst}.{leaf}", shard
    return hf_name, None


def use_gguf_blocks(model: nn.Module, names, packed: dict[str, tuple[str, object]]) -> int:
    """Before materialising a meta-built model: the linear layers that the
    checkpoint tensors `names` ({name: GGUF type}) feed keep those tensors'
    GGUF rows (LinearBase.use_gguf), and so do the routed experts whose
    stacked tensors are listed (RoutedExperts.use_gguf). Returns how many
    layers do."""
    modules = dict(model.named_modules())
    layers, experts = {}, {}
    for hf_name in names:
        m = _EXPERT_TENSOR.match(hf_name)
        if m and m["e"] is None:
            experts.setdefault(m["prefix"], {})[m["proj"].removesuffix("_proj")] = names[hf_name]
            continue
        name, _ = packed_target(hf_name, packed)
        layer = modules.get(name.rpartition(".")[0])
        if layer is None or not hasattr(layer, "use_gguf"):
            raise ValueError(f"checkpoint tensor {hf_name!r} feeds no linear layer of {type(model).__name__}")
        layers.setdefault(name.rpartition(".")[0], (layer, set()))[1].add(names[hf_name])
    for name, (layer, qtypes) in layers.items():
        try:
            layer.use_gguf(sorted(qtypes))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    for prefix, qtypes in experts.items():
        if prefix not in modules or not hasattr(modules[prefix], "use_gguf"):
            raise ValueError(f"checkpoint tensors {prefix}.* feed no routed experts of {type(model).__name__}")
        modules[prefix].use_gguf(qtypes)
    return len(layers) + len(experts)


def language_model_weights(weights: Iterable[tuple[str, torch.Tensor]], skip: tuple[str, ...],
                           skipped: list[str]) -> Iterable[tuple[str, torch.Tensor]]:
    """A multimodal checkpoint's tensors as its text model names them:
    `model.language_model.X` -> `model.X`; names starting with one of `skip`
    (vision / audio towers, MTP heads) are left out and listed in `skipped`."""
    for name, t in weights:
        if name.startswith(skip):
            skipped.append(name)
            continue
        yield name.replace("model.language_model.", "model.", 1), t


def load_packed_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                        packed: dict[str, tuple[str, object]], ignore: tuple[str, ...] = (),
                        optional: tuple[str, ...] = ()) -> set[str]:
    """Load HF-named tensors into `model`, whose module names mirror the HF ones
    except for fused projections.

    packed maps an HF sub-name to (our sub-name, shard id), e.g.
    {"q_proj": ("qkv_proj", "q"), "gate_proj": ("gate_up_proj", 0)}.
    Names ending in one of `ignore` are skipped. An unknown name, a wrong
    shape, or an expected tensor that never arrives raises ValueError naming it;
    a part under one of the `optional` prefixes (an MTP head) may be absent
    whole, not in part. Returns the names loaded.
    """
    params = dict(model.named_parameters())
    unpacked: dict[str, list[tuple[str, object]]] = {}
    for src, (dst, shard) in packed.items():
        unpacked.setdefault(dst, []).append((src, shard))

    expected = set()
    for name in params:
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last in unpacked:
            expected.update(f"{parent}.{src}.{leaf}" for src, _ in unpacked[last])
        else:
            expected.add(name)

    seen = set()
    pieces: dict[str, set] = {}     # stacked expert parameter -> the (expert, part) tensors loaded
    for hf_name, tensor in weights:
        if hf_name.endswith(ignore):
            continue
        name, shard = packed_target(hf_name, packed)
        expert = _EXPERT_TENSOR.match(hf_name)
        if expert and name not in params:
            # One expert's projection (HF checkpoints) -> its rows of the stacked tensor.
            dst, part = EXPERT_PARTS[expert["proj"]]
            e = "all" if expert["e"] is None else int(expert["e"])
            name, shard = f"{expert['prefix']}.{dst}", (e, part)
            if name in params:
                got = pieces.setdefault(name, set())
                got.add(shard)
                stacked = {p for e2, p in got if e2 == "all"}
                if len(got) == getattr(params[name], "expert_pieces", 0) or \
                        len(stacked) == (2 if dst == "gate_up_proj" else 1):
                    seen.add(name)      # all of them came: the stacked tensor is whole
        param = params.get(name)
        if param is None:
            raise ValueError(f"unknown checkpoint tensor {hf_name!r} for {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        try:
            with torch.no_grad():
                if loader is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"shape mismatch: expected {tuple(param.shape)}, got {tuple(tensor.shape)}")
                    param.data.copy_(tensor)
                elif shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"{hf_name}: {e}") from e
        seen.add(hf_name)

    missing = sorted(expected - seen)
    for prefix in optional:
        if not any(n.startswith(prefix) for n in seen):
            missing = [n for n in missing if not n.startswith(prefix)]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for {type(model).__name__}: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return seen
