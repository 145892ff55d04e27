"""DeepSeek-V4: hyper-connections, sliding / CSA / HCA attention with a shared
K=V head, lightning indexer, hash- and score-routed MoE, and the MTP head.

Numerics and module names follow transformers' modeling_deepseek_v4.py (the
parity reference); official checkpoint names are mapped in dsv4_checkpoint.py.

Tokens are flat ([T]). attn_metadata is None (one causal sequence, no cache),
a kvcache.dsv4_state.DSV4Batch (per-sequence states: sliding ring,
compressed entries, compressor carry, indexer keys; run a sequence at a
time), or the engine's AttentionMetadata of a step whose sequences all have
the same few rows (decodes, verification), which the pool turns into a
kvcache.dsv4_paged.DSV4Rows: every sequence at once, from device tensors
only, so a CUDA graph can capture it.

Tensor parallel (parallel/state.py's group of t ranks): q_b_proj, the sinks
and o_a_proj split by head group, o_b_proj row-parallel; routed experts split
into t contiguous ranges and the shared expert column/row split, with one
all-reduce for the whole MoE; embedding and head split by vocabulary. q_a,
the shared K=V projection, compressors, indexer, router, norms and
hyper-connections are replicated, and so is the cache (one K=V head).

`--quantization fp8` (use_stored): the FP8 projections keep their e4m3
weights and 128x128 block scales (parallel.quant.fp_methods.Fp8Block), the
routed experts their FP4 codes and E8M0 scales (ExpertWeights); both run
through parallel.quant's kernels. The routed experts of every format run
parallel.quant.moe.moe_forward: one grouped pass for the whole batch.
"""
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.dsv4_attn import gated_pool, index_scores_torch, sink_attention
from kvcache.dsv4_state import DSV4SequenceState
from kvcache.metadata import AttentionMetadata
from kvcache.spec import DSV4LayerSpec
from model_zoo.fused_moe import RoutedExperts
from parallel.linear import (ColumnParallelLinear, ParallelLMHead, ReplicatedLinear, RowParallelLinear,
                             VocabParallelEmbedding)
from parallel.quant.base import DENSE
from parallel.state import all_reduce, get_tp_rank, get_tp_size

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
_RATIO_TO_TYPE = {0: SWA, 4: CSA, 128: HCA}


# ---------------------------------------------------------------- config

def normalise_config(config: dict) -> dict:
    """config.json (transformers' or the legacy/official key names) -> one dict
    with layer_types, mlp_layer_types, compress_rates, rope dicts and rope_dim."""
    c = dict(config)
    n = c["num_hidden_layers"]
    rates = dict(c.get("compress_rates") or {CSA: 4, HCA: 128})
    if "compress_rate_csa" in c:
        rates[CSA] = c["compress_rate_csa"]
    if "compress_rate_hca" in c:
        rates[HCA] = c["compress_rate_hca"]
    c["compress_rates"] = rates
    c["mtp_layer_type"] = SWA
    if c.get("compress_ratios") is not None and len(c["compress_ratios"]) > n:
        c["mtp_layer_type"] = _RATIO_TO_TYPE[c["compress_ratios"][n]]   # the official MTP slot
    if not c.get("layer_types"):
        if c.get("compress_ratios") is not None:
            c["layer_types"] = [_RATIO_TO_TYPE[r] for r in c["compress_ratios"][:n]]
        else:
            c["layer_types"] = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    c["layer_types"] = list(c["layer_types"][:n])
    if not c.get("mlp_layer_types"):
        n_hash = c.get("num_hash_layers", 3)
        c["mlp_layer_types"] = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    c["mlp_layer_types"] = list(c["mlp_layer_types"][:n])
    head_dim = c.get("head_dim", 512)
    c["head_dim"] = head_dim
    prf = c.get("partial_rotary_factor")
    if prf is None:
        prf = c["qk_rope_head_dim"] / head_dim if c.get("qk_rope_head_dim") else 64 / 512
    c["rope_dim"] = int(head_dim * prf)
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
        compress = {**yarn, "rope_theta": c.get("compress_rope_theta", 160000.0)}
        compress.setdefault("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    c["rope_main"], c["rope_compress"] = main, compress
    for k, v in dict(sliding_window=128, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                     o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
                     swiglu_limit=10.0, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
                     num_experts_per_tok=6, n_shared_experts=1, max_position_embeddings=1048576).items():
        c.setdefault(k, v)
    return c


def rope_inv_freq(rope: dict, rope_dim: int, max_pos: int) -> torch.Tensor:
    """[rope_dim / 2] inverse frequencies: default or YaRN (transformers' formula;
    V4 forces attention_factor 1, so there is no cos/sin scaling)."""
    base = rope["rope_theta"]
    # On the CPU, also under a meta-device build: the same values on every device.
    pos_freqs = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float, device="cpu") / rope_dim)
    inv = 1.0 / pos_freqs
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv
    if kind != "yarn":
        raise ValueError(f"unsupported rope_type {kind!r} for deepseek_v4 (default, yarn)")
    if rope.get("attention_factor", 1.0) != 1.0:
        raise ValueError("deepseek_v4 yarn with attention_factor != 1 is not supported")
    factor = rope.get("factor") or max_pos / rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    old = rope["original_max_position_embeddings"]

    def corr(rot):
        return rope_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = corr(beta_fast), corr(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp
    return (inv / factor) * (1 - extra) + inv * extra


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False):
    """Interleaved RoPE on the trailing 2*len(inv_freq) dims of x [T, ..., D]."""
    rd = 2 * inv_freq.shape[0]
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
    cos = freqs.cos().repeat_interleave(2, -1).view(shape)
    sin = freqs.sin().repeat_interleave(2, -1).view(shape)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rd], x[..., -rd:]
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * cos + rot.float() * sin).to(x.dtype)], dim=-1)


# ---------------------------------------------------------------- small blocks

class RMSNorm(nn.Module):
    """V4 RMSNorm: weight kept in fp32, multiplied in fp32, cast once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def init_dummy(self, generator, low, high):
        self.weight.fill_(1.0)    # identity scale (models.init_dummy_weights)

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def linear(i: int, o: int) -> ReplicatedLinear:
    """A projection every rank holds whole (it can keep FP8 weights as stored)."""
    return ReplicatedLinear(i, o, bias=False)


def param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


def fp32_param(*shape) -> nn.Parameter:
    """Kept in fp32 whatever the model dtype (transformers' _keep_in_fp32_modules_strict:
    hyper-connections, sinks, position biases, router bias, norms)."""
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)


class HyperConnection(nn.Module):
    """mHC: (pre, post, comb) from the flattened streams; comb Sinkhorn-projected."""

    def __init__(self, c: dict):
        super().__init__()
        self.hc, self.iters = c["hc_mult"], c["hc_sinkhorn_iters"]
        self.eps, self.norm_eps = c["hc_eps"], c["rms_norm_eps"]
        n = (2 + self.hc) * self.hc
        self.fn = fp32_param(n, self.hc * c["hidden_size"])
        self.base = fp32_param(n)
        self.scale = fp32_param(3)

    def forward(self, streams):   # [T, hc, D]
        hc = self.hc
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        ps, qs, cs = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * ps + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * qs + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * cs + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def combine(post, comb, out, streams):
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class HyperHead(nn.Module):
    """Final collapse of the hc streams (sigmoid weights, no Sinkhorn)."""

    def __init__(self, c: dict):
        super().__init__()
        self.eps, self.norm_eps = c["hc_eps"], c["rms_norm_eps"]
        self.hc_fn = fp32_param(c["hc_mult"], c["hc_mult"] * c["hidden_size"])
        self.hc_base = fp32_param(c["hc_mult"])
        self.hc_scale = fp32_param(1)

    def forward(self, x):   # [T, hc, D] -> [T, D]
        flat = unweighted_rms(x.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.eps).unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


# ---------------------------------------------------------------- MoE

class SharedMLP(nn.Module):
    """Column-split gate/up, row-split down; returns this rank's partial sum
    (the MoE all-reduces it together with the routed experts)."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.gate_proj, self.up_proj = ColumnParallelLinear(hidden, inter), ColumnParallelLinear(hidden, inter)
        self.down_proj = RowParallelLinear(inter, hidden)
        self.limit = limit

    def forward(self, x):
        g = self.gate_proj(x).clamp(max=self.limit)
        u = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj.partial(F.silu(g) * u)     # no all-reduce: the MoE sums once


def Experts(c: dict) -> RoutedExperts:
    """This rank's routed experts with DeepSeek-V4's clamped SwiGLU (model_zoo.fused_moe)."""
    return RoutedExperts(c["n_routed_experts"], c["hidden_size"], c["moe_intermediate_size"], c["swiglu_limit"])


class Router(nn.Module):
    def __init__(self, c: dict, is_hash: bool):
        super().__init__()
        E = c["n_routed_experts"]
        if c["scoring_func"] != "sqrtsoftplus":
            raise ValueError(f"unsupported scoring_func {c['scoring_func']!r} (sqrtsoftplus)")
        self.top_k, self.scaling, self.is_hash = c["num_experts_per_tok"], c["routed_scaling_factor"], is_hash
        self.weight = param(E, c["hidden_size"])
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(c["vocab_size"], self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))

    def init_dummy(self, generator, low, high):
        """Dummy weights, and hash routes a real checkpoint could have: top_k distinct experts per token."""
        self.weight.uniform_(low, high, generator=generator)
        if self.is_hash:
            E = self.weight.shape[0]
            r = torch.rand(self.tid2eid.shape[0], E, generator=generator, device=self.tid2eid.device)
            self.tid2eid.copy_(r.argsort(dim=-1)[:, :self.top_k])
        else:
            self.e_score_correction_bias.uniform_(low, high, generator=generator)

    def forward(self, x, input_ids):
        scores = F.softplus(F.linear(x, self.weight)).sqrt()
        if self.is_hash:
            idx = self.tid2eid[input_ids].long()
        else:
            idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class MoE(nn.Module):
    def __init__(self, c: dict, is_hash: bool):
        super().__init__()
        self.gate = Router(c, is_hash)
        self.experts = Experts(c)
        self.shared_experts = SharedMLP(c["hidden_size"], c["moe_intermediate_size"] * c["n_shared_experts"],
                                        c["swiglu_limit"])

    def forward(self, x, input_ids):
        idx, w = self.gate(x, input_ids)
        return all_reduce(self.experts(x, idx, w) + self.shared_experts(x))


# ---------------------------------------------------------------- compressors

class Compressor(nn.Module):
    """Gated pooling of `ratio` tokens into one entry (HCA), or, with overlap (CSA),
    of the previous window's first half-projection (Ca) and this window's
    second (Cb) over 2 * ratio slots. Entry w sits at position w * ratio."""

    def __init__(self, c: dict, ratio: int, dim: int, overlap: bool):
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj, self.gate_proj = linear(c["hidden_size"], width), linear(c["hidden_size"], width)
        self.position_bias = fp32_param(ratio, width)
        self.kv_norm = RMSNorm(dim, c["rms_norm_eps"])

    def emit(self, raw_kv, raw_gate, raw_start: int, w0: int, w1: int, inv_freq):
        """Entries w0..w1-1 from raw projections of positions [raw_start, ...),
        which must cover window w0 - 1 (overlap, when w0 > 0) through w1 - 1."""
        r, d = self.ratio, self.dim
        if w1 <= w0:
            return raw_kv.new_zeros(0, d)
        nw = w1 - w0
        s = w0 * r - raw_start
        kv = raw_kv[s:s + nw * r].view(nw, r, -1)
        gate = raw_gate[s:s + nw * r].view(nw, r, -1)
        prev_kv = prev_gate = None
        if self.overlap:
            if w0 > 0:
                pk, pg = raw_kv[s - r:s].view(1, r, -1), raw_gate[s - r:s].view(1, r, -1)
            else:
                pk, pg = kv.new_zeros(1, r, kv.shape[-1]), gate.new_full((1, r, gate.shape[-1]), float("-inf"))
            prev_kv, prev_gate = torch.cat([pk, kv[:-1]], dim=0), torch.cat([pg, gate[:-1]], dim=0)
        return self.pool(kv, gate, prev_kv, prev_gate, torch.arange(w0, w1, device=kv.device), inv_freq)

    def pool(self, kv, gate, prev_kv, prev_gate, w, inv_freq):
        """Entries of windows w [nw] from their raw projections kv, gate
        [nw, r, width] and, with overlap, the previous windows' (prev_kv,
        prev_gate; window -1: kv 0, gate -inf)."""
        return self.finish(gated_pool(kv, gate, prev_kv, prev_gate, self.position_bias, self.overlap), w, inv_freq)

    def finish(self, pooled, w, inv_freq):
        """Pooled windows w [nw, dim] -> their entries (normed, roped at w's first position)."""
        return apply_rope(self.kv_norm(pooled), w * self.ratio, inv_freq)


class Indexer(Compressor):
    """Lightning indexer: its own overlapping compressor at index_head_dim (its
    entries are the indexer keys), and
    score(t, s) = sum_h w_{t,h} relu(q_{t,h} . k_s) / sqrt(d_I)."""

    def __init__(self, c: dict, ratio: int):
        super().__init__(c, ratio, c["index_head_dim"], overlap=True)
        self.n_heads, self.head_dim, self.topk = c["index_n_heads"], c["index_head_dim"], c["index_topk"]
        self.q_b_proj = linear(c["q_lora_rank"], self.n_heads * self.head_dim)
        self.weights_proj = linear(c["hidden_size"], self.n_heads)

    def query(self, q_res, x, positions, inv_freq):
        """The n queries' index vectors [n, h, d_I] and head weights [n, h] (fp32)."""
        q = self.q_b_proj(q_res).view(-1, self.n_heads, self.head_dim)
        return apply_rope(q, positions, inv_freq), self.weights_proj(x).float() * self.n_heads ** -0.5

    def scores(self, q_res, x, positions, keys, inv_freq):
        """[n, S] index scores of n queries against one sequence's S keys [S, d_I]."""
        return index_scores_torch(*self.query(q_res, x, positions, inv_freq), keys)


# ---------------------------------------------------------------- attention

class Attention(nn.Module):
    def __init__(self, c: dict, layer_idx: int, layer_type: str):
        super().__init__()
        H, D, nh, og = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["o_groups"]
        tp = get_tp_size()
        if og % tp or nh % og:
            raise ValueError(f"o_groups ({og}) must divide num_attention_heads ({nh}) and be divisible by the "
                             f"tensor-parallel size ({tp})")
        self.layer_idx, self.layer_type = layer_idx, layer_type
        self.num_heads, self.head_dim, self.window = nh // tp, D, c["sliding_window"]   # this rank's heads
        self.eps, self.groups = c["rms_norm_eps"], og // tp
        self.scale = D ** -0.5
        self.q_a_proj = linear(H, c["q_lora_rank"])
        self.q_a_norm = RMSNorm(c["q_lora_rank"], self.eps)
        self.q_b_proj = ColumnParallelLinear(c["q_lora_rank"], nh * D)
        self.kv_proj = linear(H, D)
        self.kv_norm = RMSNorm(D, self.eps)
        self.o_a_proj = ColumnParallelLinear(nh * D // og, og * c["o_lora_rank"])
        self.o_b_proj = RowParallelLinear(og * c["o_lora_rank"], H)
        self.sinks = fp32_param(nh // tp)
        self.sinks.weight_loader = self._load_sinks
        rope = c["rope_main"] if layer_type == SWA else c["rope_compress"]
        self.inv_freq = rope_inv_freq(rope, c["rope_dim"], c["max_position_embeddings"])
        self.comp_inv_freq = rope_inv_freq(c["rope_compress"], c["rope_dim"], c["max_position_embeddings"])
        self.ratio = c["compress_rates"].get(layer_type, 0)
        self.compressor = None
        if layer_type == CSA:
            self.compressor = Compressor(c, self.ratio, D, overlap=True)
            self.compressor.indexer = Indexer(c, self.ratio)
        elif layer_type == HCA:
            self.compressor = Compressor(c, self.ratio, D, overlap=False)

    def init_constants(self, device) -> None:
        self.inv_freq, self.comp_inv_freq = self.inv_freq.to(device), self.comp_inv_freq.to(device)

    def _load_sinks(self, param, loaded, shard_id=None):
        n = param.shape[0]
        if loaded.shape != (n * get_tp_size(),):
            raise ValueError(f"shape mismatch: expected {(n * get_tp_size(),)}, got {tuple(loaded.shape)}")
        param.data.copy_(loaded[get_tp_rank() * n:(get_tp_rank() + 1) * n])

    def forward(self, x, positions, meta):
        T = x.shape[0]
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms(self.q_b_proj(q_res).view(T, self.num_heads, self.head_dim), self.eps)
        q = apply_rope(q, positions, self.inv_freq)
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), positions, self.inv_freq)
        comp = self.compressor
        raw = idx_raw = None
        if comp is not None:
            raw = comp.kv_proj(x), comp.gate_proj(x)
            if self.layer_type == CSA:
                idx_raw = comp.indexer.kv_proj(x), comp.indexer.gate_proj(x)
        if meta is not None and meta.batched:
            o = self._rows(q, kv, positions, x, q_res, raw, idx_raw, meta)
        else:
            bounds = [0, T] if meta is None else meta.query_start_loc
            outs = []
            if meta is not None and meta.rows is not None:    # the leading decodes, all at once
                sl = slice(0, bounds[0])
                outs.append(self._rows(q[sl], kv[sl], positions[sl], x[sl], q_res[sl],
                                       None if raw is None else (raw[0][sl], raw[1][sl]),
                                       None if idx_raw is None else (idx_raw[0][sl], idx_raw[1][sl]), meta.rows))
            for i in range(len(bounds) - 1):
                a, b = bounds[i], bounds[i + 1]
                state = None if meta is None else meta.states[i].layers[self.layer_idx]
                start = 0 if meta is None else meta.states[i].length
                sl = slice(a, b)
                outs.append(self._sequence(
                    q[sl], kv[sl], positions[sl], start, state, x[sl], q_res[sl],
                    None if raw is None else (raw[0][sl], raw[1][sl]),
                    None if idx_raw is None else (idx_raw[0][sl], idx_raw[1][sl])))
            o = torch.cat(outs, dim=0)   # [T, nh, D]
        o = apply_rope(o, positions, self.inv_freq, inverse=True)
        g = o.reshape(T, self.groups, -1)
        if self.o_a_proj.quant is DENSE:
            w = self.o_a_proj.weight.view(self.groups, -1, g.shape[-1])
            g = torch.einsum("tgi,goi->tgo", g, w)
        else:
            g = self.o_a_proj.quant.grouped_matmul(g, self.groups)
        return self.o_b_proj(g.flatten(1))

    def _compress(self, comp: Compressor, cstate, raw, start: int, n: int, read: bool = True):
        """Write n new tokens at positions [start, start + n) into the carry
        and the entries they close; with read, return all entries visible
        after them."""
        r = comp.ratio
        w1 = (start + n) // r
        if cstate is None:
            return comp.emit(raw[0], raw[1], 0, 0, w1, self.comp_inv_freq)
        w0 = cstate.entries.n
        assert w0 == start // r, (w0, start, r)
        if w1 > w0:
            lo = max(0, (w0 - (1 if comp.overlap else 0)) * r)
            # the cache may store another dtype than the model computes in
            kv = torch.cat([cstate.raw_kv.read(lo, start).to(raw[0].dtype), raw[0]], dim=0)
            gate = torch.cat([cstate.raw_gate.read(lo, start).to(raw[1].dtype), raw[1]], dim=0)
            cstate.entries.append(comp.emit(kv, gate, lo, w0, w1, self.comp_inv_freq))
        cstate.raw_kv.write(start, raw[0])
        cstate.raw_gate.write(start, raw[1])
        return cstate.entries.get().to(raw[0].dtype) if read else None

    def _sequence(self, q, kv, pos, start, state, x, q_res, raw, idx_raw):
        n = q.shape[0]
        if state is None:
            keys, kpos = kv, pos
        else:
            lo = max(0, start - (self.window - 1))
            keys = torch.cat([state.window.read(lo, start).to(kv.dtype), kv], dim=0)
            kpos = torch.arange(lo, start + n, device=pos.device)
            state.window.write(start, kv)
        mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - self.window)
        store = None if state is None else state.store
        if self.compressor is not None and store is not None and not store.backend.gathers_whole_table:
            # Each row's entries read through their pool rows by the backend's kernels (dsv4-triton):
            # no [rows, heads, entries] logits, which grow with the context.
            self._compress(self.compressor, state.compressor, raw, start, n, read=False)
            if self.layer_type == CSA:
                self._compress(self.compressor.indexer, state.indexer, idx_raw, start, n, read=False)
            rows = state.compressor.entries.rows()[None].expand(n, -1)
            sel, count = self._select(store, rows, (pos + 1) // self.ratio, q_res, x, pos)
            return store.backend.attend(q, keys, mask, store, sel, count, self.sinks, self.scale)
        if self.compressor is not None:
            entries = self._compress(self.compressor, None if state is None else state.compressor, raw, start, n)
            S = entries.shape[0]
            visible = torch.arange(S, device=pos.device)[None, :] < ((pos + 1) // self.ratio)[:, None]
            if self.layer_type == CSA:
                # The indexer's carry must see every token, even before the first entry.
                ind = self.compressor.indexer
                ikeys = self._compress(ind, None if state is None else state.indexer, idx_raw, start, n)
            if self.layer_type == CSA and S > 0:
                scores = ind.scores(q_res, x, pos, ikeys, self.comp_inv_freq).masked_fill(~visible, float("-inf"))
                k = min(ind.topk, S)
                top = scores.topk(k, dim=-1).indices
                chosen = torch.zeros_like(visible).scatter_(1, top, True)
                visible = visible & chosen
            keys = torch.cat([keys, entries], dim=0)
            mask = torch.cat([mask, visible], dim=1)
        return sink_attention(q, keys, mask, self.sinks, self.scale)

    # -- all sequences at once (DSV4Rows: decodes, verification spans) ------
    def _rows(self, q, kv, pos, x, q_res, raw, idx_raw, meta):
        """Attention of B sequences of meta.q rows each, a row at a time for
        all sequences (row j sees rows < j through the rings), from device
        tensors only: what _sequence computes, without a host value."""
        n = meta.q
        store = meta.layers[self.layer_idx]
        outs = []
        for j in range(n):
            r = slice(j, None, n)         # row j of every sequence
            outs.append(self._row(q[r], kv[r], pos[r], x[r], q_res[r],
                                  None if raw is None else (raw[0][r], raw[1][r]),
                                  None if idx_raw is None else (idx_raw[0][r], idx_raw[1][r]),
                                  meta, store, j))
        return torch.stack(outs, dim=1).flatten(0, 1)   # back to sequence-major [B * n, nh, D]

    def _row(self, q, kv, pos, x, q_res, raw, idx_raw, meta, store, j):
        slots = meta.slots
        ring = store.state["window"]
        cap = ring.shape[1]
        wkeys = torch.cat([ring[slots].to(kv.dtype), kv[:, None]], dim=1)
        wmask = meta.once(("window", cap, j), lambda: self._window_mask(pos, cap))
        ring[slots, pos % cap] = kv.to(ring.dtype)
        if self.compressor is None:
            return sink_attention(q, wkeys, wmask, self.sinks, self.scale)
        # The entries: read by the pool's backend (kvcache/dsv4_attn.py) through their rows.
        r = self.ratio
        self._emit_row(self.compressor, store, "comp", raw, pos, meta, j)
        if self.layer_type == CSA:
            self._emit_row(self.compressor.indexer, store, "idx", idx_raw, pos, meta, j)
        rows = meta.entry_index(r)                                        # [B, E] every sequence's table
        count = meta.once(("count", r, j), lambda: (pos + 1) // r)        # the entries row j sees
        sel, count = self._select(store, rows, count, q_res, x, pos)
        return store.backend.attend(q, wkeys, wmask, store, sel, count, self.sinks, self.scale)

    def _select(self, store, rows, count, q_res, x, pos):
        """The entries each row attends to, as the backend takes them: HCA
        its table rows up to count; CSA the lightning indexer's top-k of
        those (their rows, -1 for a pick past count; count None)."""
        if self.layer_type != CSA or not rows.shape[1]:
            return rows, count
        ind = self.compressor.indexer
        qi, w = ind.query(q_res, x, pos, self.comp_inv_freq)
        scores = store.backend.index_scores(qi, w, store.entries["idx"], rows, count)
        top = scores.topk(min(ind.topk, rows.shape[1]), dim=-1).indices
        return torch.where(top < count[:, None], rows.gather(1, top), -1), None

    def _window_mask(self, pos, cap: int):
        """[B, cap + 1]: which ring slots (positions pos - cap .. pos - 1; older
        or stale ones fall outside the window) and the row itself it sees;
        alike in every layer, so computed once per row (DSV4Rows.once)."""
        back = (pos[:, None] - 1) - ((pos[:, None] - 1 - torch.arange(cap, device=pos.device)) % cap)
        kpos = torch.cat([back, pos[:, None]], dim=1)
        return (kpos >= 0) & (kpos > pos[:, None] - self.window)

    def _emit_row(self, comp: Compressor, store, part: str, raw, pos, meta, j: int):
        """One row of every sequence into compressor `part`'s carry ring; the
        window that closes at it (if any) pooled into its entry row
        (meta.entry_rows; -1: the discard row)."""
        r, slots = comp.ratio, meta.slots
        kv_ring, gate_ring = store.state[f"{part}_kv"], store.state[f"{part}_gate"]
        codec = store.codec if part == "comp" else None
        # An eager step where no window closes at this row only moves the carry.
        closing = meta.may_close(r, j)
        if closing:     # read before the row's own raw vectors go into the ring
            pooled = store.backend.pool_rows(kv_ring, gate_ring, slots, pos, raw[0], raw[1], comp.position_bias, r,
                                             comp.overlap)
        cap = kv_ring.shape[1]
        kv_ring[slots, pos % cap] = raw[0].to(kv_ring.dtype)
        gate_ring[slots, pos % cap] = raw[1].to(gate_ring.dtype)
        if not closing:
            return
        # the window ending at pos, when (pos + 1) % r == 0 (else what lands in the discard row)
        entry = comp.finish(pooled, ((pos + 1) // r - 1).clamp(min=0), self.comp_inv_freq)
        dest = meta.entry_rows[r][j::meta.q]
        if codec is None:
            store.entries[part][dest] = entry.to(store.entries[part].dtype)
        else:
            for k, v in codec.encode(entry.unsqueeze(1)).items():
                store.coded[k][dest] = v


def layer_spec(c: dict, i: int, layer_type: str) -> DSV4LayerSpec:
    """Cache needs of layer i of a normalised config (no model needed: the planner uses it too)."""
    return DSV4LayerSpec(i, layer_type, c["head_dim"], c["sliding_window"], c["compress_rates"].get(layer_type, 0),
                         c["index_head_dim"] if layer_type == CSA else 0)


# ---------------------------------------------------------------- layers / model

class DecoderLayer(nn.Module):
    def __init__(self, c: dict, layer_idx: int, layer_type: str, mlp_type: str):
        super().__init__()
        self.self_attn = Attention(c, layer_idx, layer_type)
        self.mlp = MoE(c, mlp_type == "hash_moe")
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.attn_hc = HyperConnection(c)
        self.ffn_hc = HyperConnection(c)

    def forward(self, h, positions, input_ids, meta):   # h [T, hc, D]
        post, comb, x = self.attn_hc(h)
        h = HyperConnection.combine(post, comb, self.self_attn(self.input_layernorm(x), positions, meta), h)
        post, comb, x = self.ffn_hc(h)
        return HyperConnection.combine(post, comb, self.mlp(self.post_attention_layernorm(x), input_ids), h)


class DeepseekV4Model(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.hc_mult = c["hc_mult"]
        self.embed_tokens = VocabParallelEmbedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c, i, c["layer_types"][i], c["mlp_layer_types"][i])
                                    for i in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.hc_head = HyperHead(c)

    def forward_streams(self, input_ids, positions, meta):
        """The pre-collapse hyper-connection state [T, hc, D] after the last layer."""
        h = self.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            h = layer(h, positions, input_ids, meta)
        return h


class DeepseekV4MTP(DecoderLayer):
    """MTP head: embedding of token t+1 and the main model's pre-collapse state
    at t -> one extra (sliding-window, score-routed) block -> own hc head and
    norm -> the shared LM head (token t+2). It keeps its own window cache:
    a DSV4SequenceState from mtp_cache_spec()."""

    def __init__(self, c: dict):
        if c["mtp_layer_type"] != SWA:
            raise ValueError(f"MTP layer of type {c['mtp_layer_type']} is not supported (sliding_attention only)")
        super().__init__(c, 0, SWA, "moe")
        H = c["hidden_size"]
        self.e_proj, self.h_proj = linear(H, H), linear(H, H)
        self.enorm, self.hnorm, self.norm = (RMSNorm(H, c["rms_norm_eps"]) for _ in range(3))
        self.hc_head = HyperHead(c)

    def draft_streams(self, embeds, streams, positions, next_ids, meta):
        """The block's pre-collapse output [T, hc, D]: what a chained draft
        feeds back in place of the main model's streams (as vLLM chains MTP)."""
        h = self.e_proj(self.enorm(embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        return self.forward(h, positions, next_ids, meta)

    def collapse(self, h):
        return self.norm(self.hc_head(h))

    def draft(self, embeds, streams, positions, next_ids, meta):
        return self.collapse(self.draft_streams(embeds, streams, positions, next_ids, meta))


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = c = normalise_config(config)
        self.model = DeepseekV4Model(c)
        self.lm_head = ParallelLMHead(c["vocab_size"], c["hidden_size"])
        self.has_mtp = c.get("num_nextn_predict_layers", 0) > 0
        self.mtp = nn.ModuleList([DeepseekV4MTP(c)] if self.has_mtp else [])

    @staticmethod
    def _metadata(positions, meta, mtp: bool = False):
        """The step's DeepSeek-V4 view: the engine's generic metadata of a
        batched step (its pool's DSV4Rows; mtp: over the MTP head's layers),
        or a DSV4Batch as given."""
        if isinstance(meta, AttentionMetadata):
            meta = meta.kv_caches.rows(meta, mtp=mtp)
        if meta is not None:
            meta.check(positions)
        return meta

    def forward_streams(self, input_ids, positions, attn_metadata):
        attn_metadata = self._metadata(positions, attn_metadata)
        h = self.model.forward_streams(input_ids, positions, attn_metadata)
        if attn_metadata is not None:
            attn_metadata.advance()
        return h

    def collapse(self, streams):
        return self.model.norm(self.model.hc_head(streams))

    @property
    def stream_shape(self) -> tuple[int, ...]:
        """One row of what forward_streams returns and mtp_streams takes."""
        return (self.config["hc_mult"], self.config["hidden_size"])

    def forward(self, input_ids, positions, attn_metadata):
        return self.collapse(self.forward_streams(input_ids, positions, attn_metadata))

    def compute_logits(self, hidden):
        return self.lm_head(hidden).float()

    def mtp_forward(self, next_ids, streams, positions, attn_metadata):
        """Draft hidden states: next_ids[i] is the token after position positions[i],
        streams[i] the main model's pre-collapse state there. Feed to compute_logits."""
        return self.mtp_collapse(self.mtp_streams(next_ids, streams, positions, attn_metadata))

    def mtp_collapse(self, h):
        return self.mtp[0].collapse(h)

    def mtp_streams(self, next_ids, streams, positions, attn_metadata):
        """mtp_forward before its collapse (mtp_collapse): [T, hc, D]."""
        attn_metadata = self._metadata(positions, attn_metadata, mtp=True)
        h = self.mtp[0].draft_streams(self.model.embed_tokens(next_ids), streams, positions, next_ids,
                                      attn_metadata)
        if attn_metadata is not None:
            attn_metadata.advance()
        return h

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from model_zoo.dsv4_checkpoint import load_into
        load_into(self, weights)

    def use_stored(self, fmts: dict[str, str]) -> int:
        """Call on the meta-built model: the layers fed by these checkpoint
        tensors ({name: "fp8" | "mxfp4"}) keep them as stored
        (model_zoo.dsv4_checkpoint.use_stored). Returns how many layers do."""
        from model_zoo.dsv4_checkpoint import use_stored
        return use_stored(self, fmts)

    # -------------------------------------------------------------- cache

    def _spec(self, i: int, layer_type: str) -> DSV4LayerSpec:
        return layer_spec(self.config, i, layer_type)

    def kv_cache_spec(self) -> list[DSV4LayerSpec]:
        """Per layer: what its cache state holds (kvcache/dsv4_state.py, dsv4_paged.py)."""
        return [self._spec(i, t) for i, t in enumerate(self.config["layer_types"])]

    def mtp_cache_spec(self) -> list[DSV4LayerSpec]:
        return [self._spec(0, SWA)]

    def new_state(self, max_rollback: int = 0, mtp: bool = False, entry_format: str | None = None
                  ) -> DSV4SequenceState:
        """A sequence's cache; entry_format (tq4, tq3, q8, ...) stores the compressed KV entries quantised."""
        spec = self.mtp_cache_spec() if mtp else self.kv_cache_spec()
        return DSV4SequenceState(spec, max_rollback, dtype=self.lm_head.weight.dtype,
                                 device=self.lm_head.weight.device, entry_format=entry_format)
