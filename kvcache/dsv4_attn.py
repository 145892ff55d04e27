"""DeepSeek-V4's attention over its compressed entries, as attention backends.

A batched V4 step (model_zoo/deepseek_v4.py Attention._row: every sequence's
row j at once) attends, per sequence, over its sliding window (a ring in the
state slot, [B, W, D] once gathered: small) and over the compressed entries
its row may see, which live in paged entry rows of the pool:

    HCA (ratio 128): every entry closed so far, table order: sel = the
                     sequence's entry rows [B, E], count = (pos + 1) // ratio;
    CSA (ratio 4):   the lightning indexer's top-k of them: sel = their rows
                     [B, k], -1 where the pick was not visible, count None.

Entry t of sequence b is used iff t < count[b] and sel[b, t] >= 0. K = V
(MQA: one entry vector for every head), and the softmax has one learned sink
logit per head (it adds to the denominator only). The backend also pools
the window each row closes from the compressors' carry rings (`pool_rows`:
gated softmax over the window's rows per channel, before the compressor's
norm and rope, which stay the model's).

    name          default on   what runs
    dsv4-torch    cpu          gathers the entries at sel (a CSA layer's
                               indexer keys: the whole table) and attends
                               with masks: model_zoo's own math, bitwise
    dsv4-triton   cuda         Triton kernels that read only the entries they
                               use through sel, looping to each sequence's
                               count on the device (dsv4_triton_kernels.py),
                               split over the entries; the window part in
                               torch, merged with the splits and the sink;
                               the pooling in one launch per compressor

dsv4-torch's cost grows with the table (what the eager step's longest
sequence holds, in a CUDA graph the bound: capacity / ratio entries), so
the pool captures graphs with it only up to a bound
(`gathers_whole_table`, dsv4_paged.MAX_GRAPH_ENTRIES); dsv4-triton's
attention reads count entries whatever the table's width. Entries in a
TurboQuant / int8 / f16 format (`store.codec`) are read in the rotated
domain: the query rotated, the entries' output de-rotated once.
`TQSERVE_ATTN_BACKEND=dsv4-torch` (kvcache/backends.py) picks the reference
on CUDA.
"""
import torch
import torch.nn.functional as F

from kvcache.backends import register_backend


def sink_attention(q, keys, mask, sinks, scale: float) -> torch.Tensor:
    """q [n, h, D] over keys [K, D] (shared by the n rows) or [n, K, D] (each
    row its own), mask [n, K] -> [n, h, D]; fp32 softmax with the fp32 sinks
    [h] as one more logit (as transformers' cat promotes it)."""
    eq = "kd" if keys.dim() == 2 else "nkd"
    logits = torch.einsum(f"nhd,{eq}->nhk", q, keys) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    s = sinks.view(1, -1, 1).expand(q.shape[0], -1, 1).float()
    combined = torch.cat([logits.float(), s], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1]
    return torch.einsum(f"nhk,{eq}->nhd", probs.to(keys.dtype), keys)


def index_scores_torch(q, w, keys) -> torch.Tensor:
    """The lightning indexer's score of n queries against keys [S, d] (one
    sequence's) or [n, S, d] (each query its own): q [n, h, d], w [n, h]
    fp32 head weights -> [n, S] = sum_h w_h relu(q_h . k) / sqrt(d)."""
    eq = "nhd,sd->nhs" if keys.dim() == 2 else "nhd,nsd->nhs"
    s = F.relu(torch.einsum(eq, q.float(), keys.float())) * q.shape[-1] ** -0.5
    return (s * w.unsqueeze(-1)).sum(dim=1)


def gated_pool(kv, gate, prev_kv, prev_gate, bias, overlap: bool) -> torch.Tensor:
    """A compressor's pooling before its norm and rope: windows kv, gate
    [nw, r, width] (+ position bias [r, width]) and, with overlap (CSA:
    width 2d), the previous windows' first halves beside the windows'
    second -> [nw, d], softmax over the window's rows per channel (fp32)."""
    gate = gate + bias
    if overlap:
        d = kv.shape[-1] // 2
        kv = torch.cat([prev_kv[..., :d], kv[..., d:]], dim=1)
        gate = torch.cat([(prev_gate + bias)[..., :d], gate[..., d:]], dim=1)
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def used(sel: torch.Tensor, count: torch.Tensor | None) -> torch.Tensor:
    """[B, K] which of sel's entries a row uses."""
    ok = sel >= 0
    if count is not None:
        ok = ok & (torch.arange(sel.shape[1], device=sel.device)[None, :] < count[:, None])
    return ok


def gather_entries(store, sel: torch.Tensor, dtype) -> torch.Tensor:
    """Entry rows sel [B, K] of `store` (a DSV4LayerStorage) -> [B, K, D] in
    dtype, coded ones dequantised; -1 reads row 0 (masked by the caller)."""
    rows = sel.clamp(min=0)
    if store.codec is None:
        return store.entries["comp"][rows].to(dtype)
    got = store.codec.dequantize({k: v[rows] for k, v in store.coded.items()}, torch.float32)
    return got.squeeze(-2).to(dtype)


class DSV4Backend:
    """index_scores(q [B, h, d], w [B, h] fp32, keys [N, d], rows [B, E],
    count [B]) -> [B, E] fp32 index scores, -inf at t >= count;
    attend(q [B, H, D], wkeys [B, W, D] (or [W, D]: the same window for
    every row, a prefill chunk's), wmask [B, W], store, sel [B, K], count
    [B] | None, sinks [H], scale) -> [B, H, D] in q's dtype. B: rows, each
    with its own entries (a prefill chunk's rows share their sequence's
    table: rows / sel may be expanded, stride 0). gathers_whole_table: the
    cost grows with the table's width (E), not with what a row uses."""
    name: str = ""
    format: str = ""
    gathers_whole_table: bool = True

    def index_scores(self, q, w, keys, rows, count):
        raise NotImplementedError

    def attend(self, q, wkeys, wmask, store, sel, count, sinks, scale: float):
        raise NotImplementedError

    def pool_rows(self, kv_ring, gate_ring, slots, pos, kv, gate, bias, ratio: int, overlap: bool):
        """gated_pool of the window each row closes: positions pos - span + 1
        .. pos (span = ratio, CSA 2 * ratio), their raw vectors from the
        sequences' carry rings [slots, cap, width] (position p at p % cap)
        but pos's own, kv / gate [B, width]; CSA's previous window is empty
        (gate -inf) for window 0. -> [B, d] (rows that close nothing pool
        whatever the ring holds)."""
        raise NotImplementedError

    def __repr__(self):
        return f"<attention backend {self.name} ({self.format})>"


@register_backend("dsv4-torch", "dsv4")
class DSV4TorchBackend(DSV4Backend):
    def index_scores(self, q, w, keys, rows, count):
        vis = torch.arange(rows.shape[1], device=rows.device)[None, :] < count[:, None]
        return index_scores_torch(q, w, keys[rows]).masked_fill(~vis, float("-inf"))

    def pool_rows(self, kv_ring, gate_ring, slots, pos, kv, gate, bias, ratio: int, overlap: bool):
        span, cap = (2 if overlap else 1) * ratio, kv_ring.shape[1]
        back = (pos[:, None] - span + 1 + torch.arange(span - 1, device=pos.device)) % cap
        kv = torch.cat([kv_ring[slots[:, None], back].to(kv.dtype), kv[:, None]], dim=1)
        gate = torch.cat([gate_ring[slots[:, None], back].to(gate.dtype), gate[:, None]], dim=1)
        prev_kv = prev_gate = None
        if overlap:
            first = ((pos + 1) // ratio <= 1)[:, None, None]      # window 0 has no previous one
            prev_kv = kv[:, :ratio].masked_fill(first, 0)
            prev_gate = gate[:, :ratio].masked_fill(first, float("-inf"))
            kv, gate = kv[:, ratio:], gate[:, ratio:]
        return gated_pool(kv, gate, prev_kv, prev_gate, bias, overlap)

    def attend(self, q, wkeys, wmask, store, sel, count, sinks, scale: float):
        if wkeys.dim() == 2:
            wkeys = wkeys.expand(q.shape[0], -1, -1)
        keys = torch.cat([wkeys, gather_entries(store, sel, wkeys.dtype)], dim=1)
        mask = torch.cat([wmask, used(sel, count)], dim=1)
        return sink_attention(q, keys, mask, sinks, scale)


@register_backend("dsv4-triton", "dsv4")
class DSV4TritonBackend(DSV4Backend):
    gathers_whole_table = False

    def index_scores(self, q, w, keys, rows, count):
        from kvcache.dsv4_triton import index_scores
        return index_scores(q, w, keys, rows, count)

    def pool_rows(self, kv_ring, gate_ring, slots, pos, kv, gate, bias, ratio: int, overlap: bool):
        from kvcache.dsv4_triton import pool_rows
        return pool_rows(kv_ring, gate_ring, slots, pos, kv, gate, bias, ratio, overlap)

    def attend(self, q, wkeys, wmask, store, sel, count, sinks, scale: float):
        from kvcache.dsv4_triton import entry_attention
        o_e, lse_e = entry_attention(q, store, sel, count, scale)    # [S, B, H, D] (rotated if coded), [S, B, H]
        eq = "kd" if wkeys.dim() == 2 else "bkd"
        logits = (torch.einsum(f"bhd,{eq}->bhk", q, wkeys) * scale).float()
        logits = logits.masked_fill(~wmask[:, None, :], float("-inf"))
        s = sinks.float().view(1, -1)
        m = torch.maximum(torch.maximum(logits.amax(dim=-1), lse_e.amax(dim=0)), s)   # finite: the sink is
        pw, pe, ps = torch.exp(logits - m[..., None]), torch.exp(lse_e - m), torch.exp(s - m)
        ent = (pe[..., None] * o_e).sum(dim=0)
        if store.codec is not None:
            ent = ent @ store.codec.rot_t(q.device).T
        num = torch.einsum(f"bhk,{eq}->bhd", pw, wkeys.float()) + ent
        return (num / (pw.sum(dim=-1) + pe.sum(dim=0) + ps)[..., None]).to(q.dtype)
