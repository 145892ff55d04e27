"""Size the KV pool from a memory budget, with bytes measured on real tensors;
the budget itself from the host's or the card's memory."""
from dataclasses import dataclass, field

import torch

from kvcache.dense_cache import DenseLayerCache
from kvcache.kv_formats import KVPolicy, is_preset
from kvcache.kv_manager import KVGroup, group_layers, snapshot_grid
from kvcache.linear_state import LinearStateCache
from kvcache.spec import DSV4LayerSpec, LayerSpec

DTYPES = {"f32": torch.float32, "float32": torch.float32, "f16": torch.float16,
          "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def kv_dtype(name: str, model_dtype: torch.dtype, k: str | None = None, v: str | None = None,
             protect_layers: int = 0, hot: str = "k") -> "torch.dtype | KVPolicy":
    """A torch dtype for plain 16/32-bit storage, or a KVPolicy for compressed
    formats (TurboQuant presets, K/V overrides, protected layers: kv_formats.py)."""
    if not (k or v or protect_layers):
        if name == "auto":
            return model_dtype
        if name in DTYPES:
            return DTYPES[name]
    if name in ("auto", "float16") or is_preset(name):
        return KVPolicy.from_names("f16" if name in ("auto", "float16") else name, k, v, protect_layers, hot)
    raise ValueError(f"unknown kv_cache_dtype {name!r}; supported: auto, {', '.join(DTYPES)}, "
                     f"tq4, tq3, tq2, k8v4, k4v3, k4v2, k3v3, ... (kvcache/kv_formats.py)")


def make_layer_cache(spec: LayerSpec, num_blocks: int, block_size: int, dtype, group_id: int,
                     num_layers: int | None = None, hot_blocks: int = 0, hot_group_id: int | None = None,
                     device: str | torch.device = "cpu"):
    if spec.per_seq:    # a fixed per-sequence state (never compressed): one slot per 'block'
        return LinearStateCache(spec, num_blocks, group_id, device)
    if isinstance(dtype, KVPolicy):
        return dtype.make_layer_cache(spec, num_blocks, block_size, group_id,
                                      num_layers if num_layers is not None else spec.layer_idx + 1,
                                      hot_blocks, hot_group_id, device)
    return DenseLayerCache(num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype,
                           group_id, spec.sliding_window, device)


# ---------------------------------------------------------------- budget

DEFAULT_KV_BYTES = 2 << 30


def available_memory() -> int:
    """The host's MemAvailable (8 GiB when /proc/meminfo cannot say)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def kv_budget(setting, available: int | None = None) -> int:
    """KV bytes from kv_cache_memory: bytes, a fraction (< 1) of `available`
    (default: the host's available memory), or None: min(2 GiB, a quarter of it)."""
    if setting is not None and not (isinstance(setting, float) and setting < 1):
        return int(setting)
    avail = available_memory() if available is None else available
    return min(DEFAULT_KV_BYTES, avail // 4) if setting is None else int(avail * setting)


def device_kv_budget(total: int, utilization: float, free_at_start: int, non_kv: int,
                     peak_activation: int) -> int:
    """KV bytes on an accelerator (vLLM's rule): the engine may use
    utilization * total, which must have been free when it started; the
    weights and every other allocation it made since (non_kv) and one step's
    activation peak come off that first."""
    gib = 1 << 30
    requested = int(total * utilization)
    if requested > free_at_start:
        raise ValueError(f"gpu_memory_utilization {utilization:g} asks for {requested / gib:.2f} GiB of the "
                         f"device's {total / gib:.2f} GiB but {free_at_start / gib:.2f} GiB was free at startup "
                         f"(other processes on it?); lower gpu_memory_utilization")
    budget = requested - non_kv - peak_activation
    if budget <= 0:
        raise ValueError(f"no device memory left for the KV cache: {utilization:g} x {total / gib:.2f} GiB - "
                         f"{non_kv / gib:.2f} GiB weights and other allocations - {peak_activation / gib:.2f} GiB "
                         f"activation peak = {budget / gib:.2f} GiB; raise gpu_memory_utilization or lower "
                         f"max_num_batched_tokens")
    return budget


@dataclass
class KVPlan:
    groups: list[KVGroup]
    num_blocks: list[int]             # per group
    block_bytes: list[int]            # per group: bytes of one block across the group's layers
    block_size: int
    layer_bytes_per_token: dict[int, int]   # per layer
    prefix_caching: bool = True       # whether the pool's contents are block-addressable
    max_rollback: int | None = None   # tokens a sequence can be truncated by (None: any)
    f16_bytes_per_token: float = 0    # what bytes_per_token would be in 16-bit storage (measured)
    mtp_specs: list = field(default_factory=list)   # an MTP head's layers, planned with the model's
    num_snapshots: int = 0            # per-sequence state snapshots (slots after the sequences'), prefix caching's
    snapshot_interval: int = 0        # tokens between a sequence's snapshots

    @property
    def capacity_tokens(self) -> int:
        """Context tokens the pool holds (bounded by the full-attention group)."""
        return self.num_blocks[0] * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one more token of context costs in layers whose cache grows with context."""
        g = self.groups[0]
        return sum(self.layer_bytes_per_token[i] for i in g.layer_ids)

    @property
    def compression_ratio(self) -> float:
        """16-bit KV bytes per token over stored bytes per token (hot tokens,
        a per-sequence cost, are not in either)."""
        return self.f16_bytes_per_token / self.bytes_per_token if self.bytes_per_token else 1.0

    @property
    def hot_bytes_per_seq(self) -> int:
        """Hot-token bytes a running sequence holds: its first and newest block."""
        return sum(2 * b for g, b in zip(self.groups, self.block_bytes) if g.hot)

    @property
    def state_bytes_per_seq(self) -> int:
        """Bytes of the fixed per-sequence state (linear-attention layers) a running sequence holds."""
        return sum(b for g, b in zip(self.groups, self.block_bytes) if g.per_seq)

    def bytes_per_token_by_kind(self) -> dict[str, int]:
        out = {}
        for g in self.groups:
            if g.hot or g.per_seq:       # per sequence, not per token (hot_bytes_per_seq, state_bytes_per_seq)
                continue
            kind = "full" if g.sliding_window is None else f"sliding_{g.sliding_window}"
            out[kind] = sum(self.layer_bytes_per_token[i] for i in g.layer_ids)
        return out

    @property
    def total_bytes(self) -> int:
        return sum((n + self.num_snapshots * g.per_seq) * b
                   for g, n, b in zip(self.groups, self.num_blocks, self.block_bytes))

    @property
    def snapshot_bytes(self) -> int:
        return sum(self.num_snapshots * b for g, b in zip(self.groups, self.block_bytes) if g.per_seq)


# Prefix caching over per-sequence state keeps snapshots of whole slots: at
# most this share of the KV budget, and this many per running sequence.
SNAPSHOT_SHARE = 0.25
SNAPSHOTS_PER_SEQ = 4


def snapshot_count(budget_bytes: int, slot_bytes: int, max_num_seqs: int, room: int) -> int:
    """State snapshots a plan keeps, within `room` bytes."""
    return int(max(0, min(SNAPSHOTS_PER_SEQ * max_num_seqs, SNAPSHOT_SHARE * budget_bytes // slot_bytes,
                          room // slot_bytes)))


def plan_kv_pool(specs: list[LayerSpec], budget_bytes: int, block_size: int, dtype: torch.dtype,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int = 1 << 30,
                 max_rollback: int = 0, mtp_specs: list[DSV4LayerSpec] | None = None,
                 snapshots: bool = False, snapshot_tokens: int | None = None) -> KVPlan:
    """mtp_specs: the MTP head's cache: DeepSeek-V4's in each sequence's state
    slot; otherwise the head's layers join the pool like the model's own
    (the plan keeps them, so that what is allocated is what was planned).
    snapshots: keep snapshots of per-sequence state every snapshot_tokens
    (kv_manager.snapshot_grid), so that prefix caching works for models
    that have such state."""
    if specs and isinstance(specs[0], DSV4LayerSpec):
        from kvcache.dsv4_paged import plan_dsv4_pool   # (it builds on this module)
        return plan_dsv4_pool(specs, budget_bytes, block_size, dtype, max_num_seqs, max_model_len, max_rollback,
                              mtp_specs, snapshots, snapshot_tokens)
    mtp_specs = list(mtp_specs or [])
    specs = _checkpointed(specs + mtp_specs, max_rollback)
    groups = group_layers(specs)
    by_idx = {s.layer_idx: s for s in specs}
    # Measure one block of each layer's real storage.
    nl = max(by_idx) + 1
    layer_block = {i: make_layer_cache(s, 1, block_size, dtype, 0, nl).nbytes for i, s in by_idx.items()}
    f16_block = {i: make_layer_cache(s, 1, block_size, torch.float16, 0, nl).nbytes for i, s in by_idx.items()}
    block_bytes = [sum(layer_block[i] for i in g.layer_ids) for g in groups]
    hot = {i: dtype.hot_block_bytes(s, block_size, nl) for i, s in by_idx.items() if not s.per_seq} \
        if isinstance(dtype, KVPolicy) else {}
    if any(hot.values()):
        groups.append(KVGroup(None, [i for i in sorted(hot) if hot[i]], hot=True))
        block_bytes.append(sum(hot.values()))
    # Sliding groups never need more than their windows (plus one step's chunk)
    # for every running sequence; give them that, or an equal-token share if the
    # budget is tighter, and the rest to the group that grows with context.
    per_token_all = sum(block_bytes) / block_size
    equal_share_blocks = max(1, int(budget_bytes / per_token_all) // block_size)
    num_blocks = [0] * len(groups)
    rest = budget_bytes
    for gi, g in enumerate(groups):
        if g.per_seq:
            continue           # below, from what the other groups leave
        if g.hot:
            # Block 0 and the newest block of every running sequence, and
            # during a step the block a chunk started mid-way in (kv_manager):
            # few chunks at once do (a long prompt's continuation); more than
            # 8 at once would preempt, as a full pool does.
            num_blocks[gi] = max_num_seqs * 2 + min(max_num_seqs, 8)
        elif g.sliding_window is None or gi == 0:
            continue
        else:
            need = max_num_seqs * (-(-(g.sliding_window - 1) // block_size) + 2) + \
                -(-max_num_batched_tokens // block_size)
            num_blocks[gi] = max(1, min(need, equal_share_blocks))
        rest -= num_blocks[gi] * block_bytes[gi]
    per_seq = any(g.per_seq for g in groups)
    interval = snapshot_grid(groups, block_size, snapshot_tokens) if snapshots and per_seq else 0
    num_snapshots = 0
    for gi, g in enumerate(groups):
        if g.per_seq:
            # A slot for each running sequence, as long as the rest holds one sequence
            # of max_model_len; fewer otherwise (a new sequence waits for a free slot).
            # Plus the pad slot every such cache holds (kvcache/linear_state.py).
            one_seq = -(-max_model_len // block_size) * block_bytes[0]
            num_blocks[gi] = int(max(1, min(max_num_seqs, (rest - one_seq) // block_bytes[gi] - 1)))
            rest -= (num_blocks[gi] + 1) * block_bytes[gi]
            if interval:
                num_snapshots = snapshot_count(budget_bytes, block_bytes[gi], max_num_seqs, rest - one_seq)
                rest -= num_snapshots * block_bytes[gi]
    num_blocks[0] = int(rest // block_bytes[0])
    if num_blocks[0] < 1:
        raise ValueError(f"KV cache budget {budget_bytes} bytes is too small for one block "
                         f"({block_bytes[0]} bytes)")
    return KVPlan(groups, num_blocks, block_bytes, block_size,
                  {i: layer_block[i] // block_size for i in by_idx if not by_idx[i].per_seq},
                  prefix_caching=not per_seq or num_snapshots > 0,
                  max_rollback=max_rollback if per_seq else None,
                  f16_bytes_per_token=sum(f16_block[i] for i in groups[0].layer_ids) / block_size,
                  mtp_specs=mtp_specs, num_snapshots=num_snapshots,
                  snapshot_interval=interval if num_snapshots else 0)


def _checkpointed(specs: list, max_rollback: int) -> list:
    """Per-sequence states keep a checkpoint for each position a rollback may return to."""
    return [s.with_rollback(max_rollback) if s.per_seq else s for s in specs]


def cache_objects(caches) -> list:
    """allocate_kv_caches' result as a list of what holds KV: the per-layer
    caches (layers without one left out), or DeepSeek-V4's one pool."""
    return [c for c in (caches if isinstance(caches, list) else [caches]) if c is not None]


def allocate_kv_caches(specs: list[LayerSpec], plan: KVPlan, dtype: torch.dtype,
                       device: str | torch.device = "cpu"):
    """Per-layer storage list (dense / TurboQuant), or one DSV4PagedCache, on device.
    (plan_kv_pool measures bytes on CPU probes: the same bytes on any device.)
    A V4 plan carries its mtp_specs, so what is allocated is what was planned."""
    if specs and isinstance(specs[0], DSV4LayerSpec):
        from kvcache.dsv4_paged import DSV4PagedCache
        return DSV4PagedCache(specs, plan.groups, plan.num_blocks, plan.block_size, plan.max_rollback, dtype,
                              device, plan.mtp_specs, capacity=plan.capacity, num_snapshots=plan.num_snapshots)
    specs = _checkpointed(specs + plan.mtp_specs, plan.max_rollback or 0)
    caches = [None] * (max(s.layer_idx for s in specs) + 1)
    by_idx = {s.layer_idx: s for s in specs}
    hot_gid = next((gi for gi, g in enumerate(plan.groups) if g.hot), None)
    hot_layers = set(plan.groups[hot_gid].layer_ids) if hot_gid is not None else set()
    for gi, g in enumerate(plan.groups):
        if gi == hot_gid:
            continue
        for i in g.layer_ids:
            hot = i in hot_layers
            # A per-sequence group's snapshots are more slots after the sequences'.
            caches[i] = make_layer_cache(by_idx[i], plan.num_blocks[gi] + plan.num_snapshots * g.per_seq,
                                         plan.block_size, dtype, gi,
                                         len(caches), plan.num_blocks[hot_gid] if hot else 0,
                                         hot_gid if hot else None, device)
    return caches
