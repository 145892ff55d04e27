"""vLLM's sleep mode: an idle engine gives its memory back without exiting.

Level 1 discards the KV pool and moves the weights to host memory (on a
GPU: pinned copies; on the CPU they already are host memory and stay);
level 2 discards both, and waking reads the weights from the checkpoint
again. Waking may come in two parts (vLLM's tags): "weights" first (an RL
trainer then updates them), "kv_cache" after.

Memory is released at the storage level: each tensor keeps its identity
(shape, dtype, every view and reference to it), its storage is resized to
nothing, and waking resizes it back and refills it. So the model, its quant
methods, the LoRA slots and the caches need no rebuilding; what cached an
address (CUDA graphs, kernel descriptors) is rebuilt or checks it. The KV
pool is what each cache class names in `pool_tensors()` (its constants:
rotations, codebooks, key means, stay); the weights are every tensor
reachable from the model.
"""
import ctypes
import ctypes.util
import dataclasses
import gc
import logging

import torch
from torch import nn

log = logging.getLogger("tqserve.engine")

# Objects of these packages (and dataclasses) are walked for the tensors
# they hold; anything else (tokenizers, threads, C handles) is not.
_OWN = ("model_zoo", "parallel", "kvcache", "engine")


def storages(root, skip: set[int] = frozenset(), private: bool = True) -> dict[str, torch.UntypedStorage]:
    """Every tensor storage reachable from root, by the first attribute path
    that reaches it ({path: storage}; ties and views share one entry),
    leaving out storages whose address is in skip and empty ones. private
    False: not through objects' _attributes (caches of derived values, such
    as a kernel descriptor holding addresses)."""
    out: dict[str, torch.UntypedStorage] = {}
    seen_ptrs: set[int] = set(skip)
    seen: set[int] = set()
    stack = [("", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen_ptrs and obj.device.type != "meta":
                seen_ptrs.add(s.data_ptr())
                out[path] = s
            continue
        children = _children(obj, private)
        # reversed: the stack pops them in their own order (paths stable across models)
        stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(children))
    return out


def _children(obj, private: bool = True) -> list[tuple[str, object]]:
    if isinstance(obj, dict):
        return [(repr(k), v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return list(enumerate(obj))
    if isinstance(obj, nn.Module):      # parameters, buffers, submodules by their names, then the rest
        own = {k: v for k, v in obj.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")}
        return [*obj._parameters.items(), *obj._buffers.items(), *obj._modules.items(), *own.items()]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) or type(obj).__module__.split(".")[0] in _OWN:
        return [(k, v) for k, v in getattr(obj, "__dict__", {}).items() if private or not k.startswith("_")]
    return []


def as_bytes(s: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)


def release(stores: dict[str, torch.UntypedStorage]) -> dict[str, int]:
    """Resize every storage to nothing; returns their sizes (to resize back).
    One that cannot be resized (memory it does not own: a mapped file) stays,
    and leaves `stores`."""
    sizes = {}
    for path, s in list(stores.items()):
        n = s.nbytes()
        try:
            s.resize_(0)
        except RuntimeError:
            del stores[path]
            continue
        sizes[path] = n
    return sizes


def give_back_memory(device: torch.device) -> None:
    """Hand freed memory to the system: the CUDA allocator's cache, or on
    the CPU glibc's free lists (malloc_trim), which keep it otherwise."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):      # not glibc: its free() returns what it can
        pass


@dataclasses.dataclass
class Asleep:
    """What a sleeping worker gave back, to take again when it wakes."""
    level: int
    kv: dict[str, torch.UntypedStorage]
    kv_sizes: dict[str, int]
    weights: dict[str, torch.UntypedStorage]
    weight_sizes: dict[str, int]                    # empty: the weights stayed where they were
    host: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)    # level 1 on a GPU

    @property
    def freed_bytes(self) -> int:
        return sum(self.kv_sizes.values()) + sum(self.weight_sizes.values())
