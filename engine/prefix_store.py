"""The prefix cache kept across restarts (`prefix_cache_file`): what the
engine has cached when it closes is written to a file, and read back into
the pool when an engine with the same model, KV formats and block size
starts, so that a restarted server hits its long system prompts and
documents at once. With TurboQuant the file holds the compressed blocks
(3-4 bits a value), a fraction of a 16-bit cache's bytes.

What is saved: every cached block of every group of the pool whose tokens
chain back to an unsalted root (a salted chain's hashes differ from one
process to the next), with its rows in each layer that stores into that
group (per-layer caches' `pool_tensors_by_group`), and the block's tokens;
loading recomputes each hash from the tokens (KVCacheManager's formula:
Python hashes of int tuples do not change between processes), puts the rows
into a free block and registers it, unreferenced, as a finished request
leaves its blocks. A file made by another model, KV format, block size or
calibration (every cache constant is fingerprinted) is ignored with a
warning. Models with per-sequence state (linear attention's snapshots,
DeepSeek-V4's pool) and tensor parallelism are not supported.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

import torch

from engine import sleep_mode
from kvcache.kv_manager import KVCacheManager

log = logging.getLogger("tqserve.engine")

VERSION = 1


def unsupported(caches, groups, tp: int) -> str | None:
    """Why this engine's prefix cache cannot be kept in a file, or None."""
    if tp > 1:
        return "it is split over tensor-parallel ranks"
    if not isinstance(caches, list):
        return "DeepSeek-V4's pool keeps per-sequence state"
    if any(g.per_seq or g.ratio != 1 for g in groups):
        return "the model keeps per-sequence state (linear attention)"
    return None


def _layers(caches) -> list[tuple[int, dict[int, list[torch.Tensor]]]]:
    return [(i, c.pool_tensors_by_group()) for i, c in enumerate(caches) if c is not None]


def fingerprint(caches, config: dict, block_size: int, kv_name: str) -> str:
    """What a saved block's rows mean: the model's config, the block size, the
    pool's tensor layouts and every cache constant (rotations, codebooks,
    calibrated key means)."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(f"{block_size}|{kv_name}".encode())
    pool = {}
    for i, by_group in _layers(caches):
        for g, ts in sorted(by_group.items()):
            for t in ts:
                pool[t.untyped_storage().data_ptr()] = t
                h.update(f"{i}|{g}|{t.dtype}|{tuple(t.shape[1:])}".encode())
    for path, s in sorted(sleep_mode.storages(caches, skip=set(pool), private=False).items()):
        h.update(path.encode())
        h.update(sleep_mode.as_bytes(s).cpu().numpy().tobytes())
    return h.hexdigest()


def _slots(blocks: list[int], bs: int) -> torch.Tensor:
    return (torch.tensor(blocks, dtype=torch.long)[:, None] * bs + torch.arange(bs)).flatten()


def save(path: str, kv: KVCacheManager, caches, stamp: str) -> int:
    """Write the cached blocks (with unsalted token chains) to path; returns how many."""
    bs, layers, memo = kv.block_size, _layers(caches), {}
    groups = []
    for gi, pool in enumerate(kv.pools):
        known = [(h, next(iter(held))) for h, held in pool.cached.items() if kv.chain_known(h, memo)]
        tensors = [t for _, by_group in layers for t in by_group.get(gi, [])]
        idx = _slots([b for _, b in known], bs)
        groups.append({"entries": [kv.block_tokens[h] for h, _ in known],
                       "rows": [t.index_select(0, idx.to(t.device)).cpu() for t in tensors] if known else []})
    tmp = path + ".tmp"
    torch.save({"version": VERSION, "stamp": stamp, "groups": groups}, tmp)
    os.replace(tmp, path)         # (a crash mid-write leaves the old file)
    return sum(len(g["entries"]) for g in groups)


def load(path: str, kv: KVCacheManager, caches, stamp: str) -> int:
    """Read a saved prefix cache into free blocks; returns the blocks restored."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:          # (a truncated or foreign file: the engine starts cold)
        log.warning("prefix cache file %s not read: %s", path, e)
        return 0
    if data.get("version") != VERSION or data.get("stamp") != stamp or len(data["groups"]) != len(kv.pools):
        log.warning("prefix cache file %s is another model's, KV format's or block size's: ignored", path)
        return 0
    bs, layers = kv.block_size, _layers(caches)
    restored = 0
    for gi, (pool, saved) in enumerate(zip(kv.pools, data["groups"])):
        src, dst, room = [], [], pool.num_free     # (at start every free block is a distinct, uncached one)
        for k, (parent, tokens) in enumerate(saved["entries"]):
            h = hash((parent, tuple(tokens)))
            if pool.lookup(h) is not None or len(dst) == room:
                continue
            b = pool.allocate()
            pool.cache(b, h)
            kv.block_tokens[h] = (parent, tuple(tokens))
            pool.free(b)            # unreferenced and cached: a hit's to take
            src.append(k)
            dst.append(b)
        if not dst:
            continue
        tensors = [t for _, by_group in layers for t in by_group.get(gi, [])]
        s_idx, d_idx = _slots(src, bs), _slots(dst, bs)
        for t, rows in zip(tensors, saved["rows"]):
            t.index_copy_(0, d_idx.to(t.device), rows.index_select(0, s_idx).to(t.device, t.dtype))
        restored += len(dst)
    return restored
