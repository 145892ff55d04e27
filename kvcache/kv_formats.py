"""KV cache formats: preset names, K/V overrides, and the per-layer policy.

Presets (kv_cache_dtype):
  f16                 16-bit K and V (plain dense storage)
  tq4, tq3, tq2       TurboQuant K and V at 4 / 3 / 2 bits
  k{K}v{V}            K and V separately: K in {16, 8, 4, 3, 2}, V in {16, 8, 4, 3, 2}
                      (8 = int8 with a per-vector scale; 2-4 = TurboQuant; 16 = f16),
                      e.g. k8v4, k4v3, k4v2, k3v3
  ...g32 / ...g64     suffix: one norm per sub-block of 32 / 64 values (TurboQuant parts)
Component names (kv_cache_dtype_k / kv_cache_dtype_v overrides): f16 | q8 | 8 |
  tq4 | 4 | tq3 | 3 | tq2 | 2, optionally with g32 / g64.

Budget presets: tq4, tq3 and tq2 are byte budgets: the storage of 4 / 3 / 2-bit
K and V (4.25 / 3.25 / 2.25 bits per value with head_dim 64's norms), split
between K and V per model. The engine scores every (K, V) split of KV_MENU
that fits on a calibration text (engine/kv_calibration.py) and takes the best
(choose_split): SmolLM2 gets k4v4 / k3v3, Gemma3 k5v3 / k4v2 (measured in
tests/bench/results/kv_levers_*.md). One split for all layers: per-layer
splits chosen the same way scored better on the calibration text but worse
on held-out perplexity. Without calibration they mean uniform K = V = 4 / 3 / 2.

Policy: the first and last `protect_layers` layers and every sliding-window
layer (unless quantize_sliding) are kept f16; every other layer gets (K, V),
or its calibrated split.

Hot tokens (hot = "k", the default, or "kv"; "" = off): in full-attention
layers with TurboQuant K (or V, for "kv"), each sequence's first block and
the block being filled are also held int8 (keys, or keys and values) in the
manager's hot group, and queries read them from there (kvcache/tq_cache.py).
Measured on 8 x 1,024 tokens (tests/bench/results/kv_levers_*): SmolLM2 k4v4
+3.31% -> +1.55% perplexity ("k") / +0.98% ("kv"), k3v3 +11.7% -> +4.7% /
+3.2%. Cost: two int8 key blocks per running sequence ("k": ~1.5% of a
2,048-token sequence's tq4 bytes; "kv" twice that).
"""
from dataclasses import dataclass
import re

import torch

from kvcache.dense_cache import DenseLayerCache
from kvcache.spec import LayerSpec
from kvcache.tq_cache import TQLayerCache
from kvcache.turboquant import F16, INT8, ComponentFormat, tq

BUDGETS = {"tq4": 4, "tq3": 3, "tq2": 2}    # bits: the uniform split whose bytes the budget is
# TurboQuant (K bits, V bits) splits the budget presets choose from (int8 K
# was tried as well: calibration never picked it).
KV_MENU = [(k, v) for k in (2, 3, 4, 5) for v in (2, 3, 4)]

PRESETS = ["f16", "tq4", "tq3", "tq2", "k8v8", "k8v4", "k8v3", "k8v2", "k4v4", "k4v3", "k4v2",
           "k3v3", "k3v2", "k2v2", "k16v4", "k16v3", "k3v3g32", "tq4g32", "tq3g32"]


def component(name: str) -> ComponentFormat:
    """'f16' | '16' | 'q8' | 'int8' | '8' | 'tq4' | '4' | ... with optional 'g32' / 'g64'."""
    m = re.fullmatch(r"(f16|16|q8|int8|8|(?:tq)?([2345]))(?:g(32|64))?", name.strip().lower())
    if not m:
        raise ValueError(f"unknown KV component format {name!r}; use f16, q8, tq5, tq4, tq3 or tq2 "
                         f"(optionally with g32 / g64)")
    group = int(m.group(3)) if m.group(3) else None
    if m.group(2):
        return tq(int(m.group(2)), group)
    if group:
        raise ValueError(f"{name!r}: sub-block norms apply to TurboQuant formats only")
    return F16 if m.group(1) in ("f16", "16") else INT8


def parse_preset(name: str) -> tuple[ComponentFormat, ComponentFormat]:
    n = name.strip().lower()
    if n in ("f16", "float16"):
        return F16, F16
    m = re.fullmatch(r"tq([234])(g32|g64)?", n)
    if m:
        c = component(m.group(1) + (m.group(2) or ""))
        return c, c
    m = re.fullmatch(r"k(16|8|[2345])v(16|8|[234])(g32|g64)?", n)
    if m:
        g = m.group(3) or ""
        k, v = m.group(1), m.group(2)
        return (component(k + (g if k in "234" else "")), component(v + (g if v in "234" else "")))
    raise ValueError(f"unknown kv_cache_dtype {name!r}")


def is_preset(name: str) -> bool:
    try:
        parse_preset(name)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class KVPolicy:
    """What make_layer_cache gets instead of a torch dtype for compressed formats."""
    k: ComponentFormat
    v: ComponentFormat
    protect_layers: int = 0
    quantize_sliding: bool = False
    seed: int = 0
    f16_dtype: torch.dtype = torch.float16
    budget: int | None = None            # calibrate the K/V split within k{b}v{b}'s bytes (BUDGETS)
    hot: str = "k"                       # "" | "k" | "kv": int8 copies of sink and newest blocks

    @classmethod
    def from_names(cls, preset: str, k: str | None = None, v: str | None = None,
                   protect_layers: int = 0, hot: str = "k", **kw) -> "KVPolicy":
        kf, vf = parse_preset(preset)
        if k:
            kf = component(k)
        if v:
            vf = component(v)
        if protect_layers < 0:
            raise ValueError(f"kv_protect_layers must be >= 0, got {protect_layers}")
        hot = {"off": "", "none": ""}.get(hot, hot)
        if hot not in ("", "k", "kv"):
            raise ValueError(f"kv_hot must be off, k or kv, got {hot!r}")
        budget = BUDGETS.get(preset.strip().lower()) if not (k or v) else None
        return cls(kf, vf, protect_layers, budget=budget, hot=hot, **kw)

    @property
    def name(self) -> str:
        return f"k={self.k.name},v={self.v.name},protect={self.protect_layers},hot={self.hot or 'off'}"

    def compressed(self, spec: LayerSpec, num_layers: int) -> bool:
        """Whether this layer gets the policy's formats (not kept f16)."""
        i, n = spec.layer_idx, self.protect_layers
        return not (i < n or i >= num_layers - n or
                    (spec.sliding_window is not None and not self.quantize_sliding))

    def layer_formats(self, spec: LayerSpec, num_layers: int) -> tuple[ComponentFormat, ComponentFormat]:
        if not self.compressed(spec, num_layers):
            return F16, F16
        return self.k, self.v

    def layer_hot(self, spec: LayerSpec, num_layers: int) -> str:
        """The layer's hot mode: "" unless it is full attention and hot would
        copy a TurboQuant component (int8 / f16 ones are exact enough)."""
        k, v = self.layer_formats(spec, num_layers)
        if not self.hot or spec.sliding_window is not None:
            return ""
        return self.hot if k.kind == "tq" or (self.hot == "kv" and v.kind == "tq") else ""

    def hot_block_bytes(self, spec: LayerSpec, block_size: int, num_layers: int) -> int:
        """Bytes of one hot-group block of this layer (0 if it has none)."""
        hot = self.layer_hot(spec, num_layers)
        if not hot:
            return 0
        return TQLayerCache(0, block_size, spec.num_kv_heads, spec.head_dim, *self.layer_formats(spec, num_layers),
                            0, hot=hot, hot_blocks=1, hot_group_id=0).nbytes

    def describe(self, specs: list, layer_bytes: dict[int, int]) -> str:
        """'layers 0-9 k4v4 204 B/token, 10 k5v3 204 B/token, ...' (runs of equal format)."""
        n = max(s.layer_idx for s in specs) + 1
        runs = []
        for s in sorted(specs, key=lambda s: s.layer_idx):
            k, v = self.layer_formats(s, n)
            fmt = "f16" if k == F16 and v == F16 else f"k:{k.name} v:{v.name}"
            key = (fmt, layer_bytes[s.layer_idx])
            if runs and runs[-1][0] == key and runs[-1][2] == s.layer_idx - 1:
                runs[-1][2] = s.layer_idx
            else:
                runs.append([key, s.layer_idx, s.layer_idx])
        return ", ".join(f"{a}{'' if a == b else f'-{b}'} {fmt} {nb} B/token" for (fmt, nb), a, b in runs)

    def make_layer_cache(self, spec: LayerSpec, num_blocks: int, block_size: int, group_id: int,
                         num_layers: int, hot_blocks: int = 0, hot_group_id: int | None = None,
                         device: str | torch.device = "cpu"):
        k, v = self.layer_formats(spec, num_layers)
        if k == F16 and v == F16:
            return DenseLayerCache(num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                                   self.f16_dtype, group_id, spec.sliding_window, device)
        d = spec.head_dim
        if d < 8 or d & (d - 1):
            raise ValueError(f"layer {spec.layer_idx}: compressed KV formats need a power-of-two "
                             f"head_dim >= 8 (Walsh-Hadamard rotation), got {d}; use kv_cache_dtype f16")
        hot = self.layer_hot(spec, num_layers) if hot_group_id is not None else ""
        return TQLayerCache(num_blocks, block_size, spec.num_kv_heads, spec.head_dim, k, v, group_id,
                            spec.sliding_window, seed=layer_seed(self.seed, spec.layer_idx), device=device,
                            hot=hot, hot_blocks=hot_blocks, hot_group_id=hot_group_id)


def layer_seed(seed: int, layer_idx: int) -> int:
    """Deterministic per-layer rotation seed."""
    return (seed * 1_000_003 + layer_idx * 7919 + 12345) & 0x7FFFFFFF


def choose_split(options: dict[int, dict[tuple, tuple[float, float]]], budget: int) -> tuple[int, int]:
    """The (K bits, V bits) split, one for every layer, with the least summed
    error among those storing no more than uniform budget-bit K and V.
    options[layer][split] = (bits per token, error)."""
    cost = {key: sum(o[key][0] for o in options.values()) for key in KV_MENU}
    err = {key: sum(o[key][1] for o in options.values()) for key in KV_MENU}
    return min((key for key in KV_MENU if cost[key] <= cost[(budget, budget)]), key=lambda key: err[key])
