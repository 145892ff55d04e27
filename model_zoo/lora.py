"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors)
on a model's linear layers.

`ModelLoRA` is what every tensor-parallel rank holds: the model's adapter
slots (parallel/lora.py) and which adapter each slot holds; the leader's
also a cache of the adapters read from disk. The leader decides which
adapter goes in which slot (engine/lora.py), and its step plan carries the
adapter (whole) to every rank, which loads its own part before the step
that needs it: only the leader reads the files, whose reading it can fail
one request for (a follower's failed read would end the whole group).
"""
import json
import logging
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from model_zoo.layers import PACKED, packed_target
from parallel.lora import LoRAContext, token_add_for

log = logging.getLogger("tqserve.lora")

_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")


@dataclass
class LoRAAdapter:
    """An adapter read for one model: per linear layer of the model, the
    (shard id, A, scaled B) of each sub-projection it targets, whole
    (unsharded), in the model's dtype on the CPU."""
    path: str
    rank: int
    layers: dict[str, list[tuple[object, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for parts in self.layers.values() for _, a, b in parts)


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: a key matches a module name it ends (or fully matches as a regex)."""
    for key, value in (pattern or {}).items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def read_peft(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT adapter directory."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r} is not a directory")
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: cannot read adapter_config.json ({e})") from None
    st, pt = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    if os.path.exists(st):
        from safetensors.torch import load_file
        tensors = load_file(st)
    elif os.path.exists(pt):
        tensors = torch.load(pt, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors (nor adapter_model.bin)")
    return cfg, tensors


def adapter_for(model: nn.Module, path: str, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check a PEFT adapter against `model`'s layers: every tensor
    must target a linear layer of it with the right shape, at a rank up to
    max_rank. Raises ValueError naming what does not fit."""
    cfg, tensors = read_peft(path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, ok in (("use_dora", False), ("bias", "none")):
        if cfg.get(key, ok) != ok:
            raise ValueError(f"LoRA adapter {path!r}: {key} {cfg[key]!r} is not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {path!r}: modules_to_save {cfg['modules_to_save']} (whole trained "
                         f"modules) is not supported")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a lora_A / lora_B weight of a "
                             f"linear layer (embedding adapters, DoRA magnitudes are not supported)")
        module = m["module"].replace("model.language_model.", "model.", 1)
        pairs.setdefault(module, {})[m["ab"]] = t
    modules = dict(model.named_modules())
    adapter = LoRAAdapter(path, 0)
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_{'A' if 'A' in ab else 'B'} only")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: rank {r} of {module} is above --max-lora-rank {max_rank}")
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", r))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        name, shard = packed_target(module + ".weight", PACKED)
        layer = modules.get(name.rpartition(".")[0])
        if layer is None or getattr(layer, "lora", None) is None:
            raise ValueError(f"LoRA adapter {path!r}: {module} is not a linear layer of "
                             f"{type(model).__name__} that adapters can target")
        a = a.to(dtype)
        b = (b.float() * scale).to(dtype)
        try:
            layer.lora_parts(shard, a, b)       # shapes checked now, not at the step that loads it
        except ValueError as e:
            raise ValueError(f"LoRA adapter {path!r}: {module}: {e}") from None
        adapter.layers.setdefault(name.rpartition(".")[0], []).append((shard, a, b))
        adapter.rank = max(adapter.rank, r)
    if not adapter.layers:
        raise ValueError(f"LoRA adapter {path!r} has no LoRA weights")
    return adapter


class ModelLoRA:
    """A model's adapter slots on this rank (module docstring)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.ctx = LoRAContext(token_add_for(device))
        self.layers = {name: m for name, m in model.named_modules() if hasattr(m, "enable_lora")}
        for m in self.layers.values():
            m.enable_lora(self.ctx, max_loras, max_rank, dtype, device)
        self.max_cpu_loras = max_cpu_loras
        self.cache: OrderedDict[int, LoRAAdapter] = OrderedDict()    # lora_int_id -> adapter, least recent first
        self.slots: list[int | None] = [None] * max_loras            # lora_int_id in each slot
        self.keep: set[int] = set()     # the leader's: adapters going into slots (not evicted before they load)

    @property
    def nbytes(self) -> int:
        return sum(m.lora.nbytes for m in self.layers.values())

    def read(self, lora_int_id: int, path: str) -> LoRAAdapter:
        """The adapter, from the cache or read (and checked) from path."""
        adapter = self.cache.get(lora_int_id)
        if adapter is None:
            adapter = adapter_for(self.model, path, self.max_rank, self.dtype)
            self.cache[lora_int_id] = adapter
        self.cache.move_to_end(lora_int_id)
        self._evict()
        return adapter

    def _evict(self) -> None:
        """Down to max_cpu_loras: the least recently used first, never one in
        a slot, about to load into one, or the newest (an adapter dropped is
        read again if needed)."""
        newest = next(reversed(self.cache), None)
        while len(self.cache) > self.max_cpu_loras:
            victim = next((k for k in self.cache if k not in self.slots and k not in self.keep and k != newest),
                          None)
            if victim is None:
                break
            self.cache.pop(victim)

    @torch.inference_mode()
    def load(self, slot: int, lora_int_id: int, adapter: LoRAAdapter) -> None:
        """Put the adapter (the leader's copy) in slot (every layer's slot is
        rewritten: layers it does not target get zeros)."""
        if self.slots[slot] == lora_int_id:
            return
        for m in self.layers.values():
            m.lora.clear(slot)
        for name, parts in adapter.layers.items():
            layer = self.layers[name]
            for shard, a, b in parts:
                sub, offset, a, b = layer.lora_parts(shard, a, b)
                layer.lora.set(slot, sub, offset, a.to(self.device), b.to(self.device))
        self.slots[slot] = lora_int_id
        self._evict()       # (what the slot held may go now)
