"""Attention backends: the code that reads one storage format's paged blocks.

A storage format (kvcache/layer_cache.py's LayerCache subclasses: "dense",
"tq") owns its tensors and writes them; a backend attends over them. Each
backend is registered by name for one format, and a layer cache takes its
backend from the registry by its format and its device:

    name            format  default on   what runs
    dense-cpu       dense   cpu          the compiled C++ decode kernel over the cache rows
                                         in place (dense_cpu.py); prefill as dense-torch
    dense-torch     dense   -            torch SDPA over gathered blocks (dense_cache.py)
    dense-triton    dense   cuda         Triton paged attention, one launch for the
                                         decodes and one for all prefills (dense_triton.py)
    tq-cpu          tq      cpu          the compiled C++ kernel (tq_cpu.py; the torch
                                         reference for head dims it was not built for)
    tq-torch        tq      -            the torch reference (tq_cache.py)
    tq-triton       tq      cuda         Triton over the compressed blocks (tq_triton.py)
    dsv4-torch      dsv4    -            DeepSeek-V4's batched steps: entries gathered and
                                         masked (dsv4_attn.py, the reference)
    dsv4-triton     dsv4    cuda         the same reading only the entries used (dsv4_triton.py)

Any other device gets the torch backend of its format. Overrides, strongest
first: an explicit name (DenseLayerCache(backend=...), `cache.backend =
name`); TQSERVE_ATTN_BACKEND, a comma-separated list of names, each applying
to its own format (e.g. `dense-torch` to run SDPA on CUDA). TQSERVE_TQ_CPU=torch
stays what it was: tq-cpu reads it at every call and then runs tq-torch's
code; TQSERVE_DENSE_CPU=torch likewise makes dense-cpu run dense-torch's
attention (read at each step).

A backend is stateless (one shared instance per name): everything per step
comes in the AttentionMetadata, everything per layer in the cache. The
default forward() splits the flat batch into one batched decode call and one
prefill call per sequence, which is what the CPU backends (and tq-triton)
do; a backend that handles the whole batch in fewer launches overrides it.
Implementations register themselves when their module is imported; the
registry imports the built-in ones on first lookup (none of them imports
triton before a kernel runs).
"""
import os

import torch

_REGISTRY: dict = {}
_DEFAULTS = {("dense", "cpu"): "dense-cpu", ("dense", "cuda"): "dense-triton",
             ("tq", "cpu"): "tq-cpu", ("tq", "cuda"): "tq-triton", ("dsv4", "cuda"): "dsv4-triton"}
_FALLBACK = {"dense": "dense-torch", "tq": "tq-torch", "dsv4": "dsv4-torch"}
_BUILTIN = ("kvcache.dense_cache", "kvcache.dense_cpu", "kvcache.dense_triton", "kvcache.tq_cache",
            "kvcache.tq_cpu", "kvcache.tq_triton", "kvcache.dsv4_attn")


class AttentionBackend:
    """Attention over the paged blocks of one storage format.

    forward(cache, q, meta, scale): q [T, Hq, D], the whole flat batch
    (decodes first, as AttentionMetadata lays it out) -> [T, Hq, D]. The
    one-call entry points, which the default forward uses:
    decode(cache, q [B, Hq, D], block_tables [B, W], seq_lens [B], scale,
    *extra_tables) and prefill(cache, q [Lq, Hq, D], block_table [W],
    seq_len int, scale, *extra_tables, key_limit=None); extra_tables are the
    block tables of the cache's extra_groups (TurboQuant's hot tokens).

    key_limit (a backend with supports_key_limits): [Lq] long, the last key
    position each query sees (>= its own, < seq_len); a sliding layer's window
    still counts back from the query's own position. None: causal. It is how
    a bidirectional span (Gemma 3's image tokens) attends; forward takes it
    from meta.key_limits_t.
    """
    name: str = ""
    format: str = ""
    # A decode-only step through this backend (its forward and the cache
    # writes it does) may be captured in a CUDA graph: static shapes from the
    # metadata's tensors only, no host syncs, no host-to-device copies.
    capturable: bool = False
    # prefill honours key_limit (bidirectional spans; see above).
    supports_key_limits: bool = False

    def forward(self, cache, q: torch.Tensor, meta, scale: float) -> torch.Tensor:
        group = meta.groups[cache.group_id]
        extra = [meta.groups[g].block_tables for g in cache.extra_groups]
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self.decode(cache, q[:nd], group.block_tables[:nd], meta.seq_lens_t[:nd], scale,
                                   *[t[:nd] for t in extra])
        qsl, lim = meta.query_start_loc, meta.key_limits_t
        for i in range(nd, meta.num_seqs):
            s, e = qsl[i], qsl[i + 1]
            kw = {} if lim is None else {"key_limit": lim[s:e]}
            out[s:e] = self.prefill(cache, q[s:e], group.block_tables[i], meta.seq_lens[i], scale,
                                    *[t[i] for t in extra], **kw)
        return out

    def decode(self, cache, q, block_tables, seq_lens, scale, *extra_tables):
        raise NotImplementedError

    def store(self, cache, slot_mapping, k, v, hot_slots=None) -> bool:
        """Write a step's new K/V rows into cache (with hot_slots also a
        TurboQuant cache's hot copies), if this backend has a faster way than
        the cache's own write (dense-cpu, dense-triton, tq-triton); False: it
        wrote nothing and the cache writes them."""
        return False

    def prefill(self, cache, q, block_table, seq_len, scale, *extra_tables):
        raise NotImplementedError

    def __repr__(self):
        return f"<attention backend {self.name} ({self.format})>"


def register_backend(name: str, format: str):
    """Class decorator: register one (stateless) instance under `name` for
    storage format `format`."""
    def deco(cls):
        if name in _REGISTRY and type(_REGISTRY[name]) is not cls:
            raise ValueError(f"attention backend {name!r} is already registered")
        cls.name, cls.format = name, format
        _REGISTRY[name] = cls()
        return cls
    return deco


def _load_builtin() -> None:
    import importlib
    for m in _BUILTIN:
        importlib.import_module(m)


def backend_names(format: str | None = None) -> list[str]:
    _load_builtin()
    return sorted(n for n, b in _REGISTRY.items() if format is None or b.format == format)


def get_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; registered: {', '.join(backend_names())}")
    return _REGISTRY[name]


def _env_choice(format: str) -> str | None:
    names = [n.strip() for n in os.environ.get("TQSERVE_ATTN_BACKEND", "").split(",") if n.strip()]
    for n in names:
        if get_backend(n).format == format:
            return n
    return None


def backend_for(format: str, device, name: str | None = None) -> AttentionBackend:
    """The backend a cache of storage format `format` on `device` uses:
    `name` when given, else the environment's choice, else the device's
    default (see the module docstring)."""
    if name is None:
        name = _env_choice(format)
    if name is None:
        name = _DEFAULTS.get((format, torch.device(device).type), _FALLBACK.get(format))
    if name is None:
        raise ValueError(f"no attention backend for storage format {format!r}")
    b = get_backend(name)
    if b.format != format:
        raise ValueError(f"attention backend {name!r} reads {b.format!r} storage, not {format!r}")
    return b
