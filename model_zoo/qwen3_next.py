"""Qwen3-Next (Qwen3-Next-80B-A3B): hybrid layers, three Gated DeltaNet
linear-attention layers to one gated full-attention layer (`layer_types`),
and a routed MoE with a gated shared expert.

Numerics follow transformers' modeling_qwen3_next.py:
  norms       (1 + w) RMSNorm in fp32 (GemmaRMSNorm), also on q and k per head;
              the DeltaNet output norm is w * rms(x), gated by silu(z)
  attention   q_proj gives each head's query and output gate side by side
              ([q_h, gate_h] per head); rotary on the first
              partial_rotary_factor of head_dim; output * sigmoid(gate)
  DeltaNet    in_proj_qkvz / in_proj_ba grouped per key head
              ([q, k, v..., z...] and [b..., a...] for each of the
              linear_num_key_heads), a causal depthwise conv + SiLU over
              q|k|v, then the gated delta rule (model_zoo/gated_delta.py) with
              beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
  MoE         Qwen3-MoE's router and experts (model_zoo/qwen3_moe.py) plus
              sigmoid(shared_expert_gate(x)) * shared_expert(x)

The linear layers keep a fixed per-sequence state (conv inputs + recurrent
state, kvcache/linear_state.py) in a slot of the pool's per-sequence group;
the full-attention layers use the paged KV cache (any KV format). Prefix
caching is off for this model (the state is not block-addressable); the
slot keeps the state after each of a sequence's last 1 + max_rollback
positions, so speculative decoding rolls rejected drafts back. The MTP head
(Qwen3NextMTP, `mtp_num_hidden_layers: 1`) drafts for it. Tensor parallel: attention and MoE as Qwen3-MoE,
DeltaNet layers by key head (GatedDeltaNet).

GGUF blocks kept as stored (`--quantization gguf`, use_stored): every linear
projection (attention, DeltaNet, shared expert, the MTP head's fc and layer),
the routed experts (GGUFExperts), the embedding and the head. The DeltaNet
layers take the file's layout where llama.cpp's converter moved values inside
rows (model_zoo/gguf_loader.py): qwen3next's in_proj_qkvz as its two GGUF
tensors (attn_qkv -> in_proj_qkv, attn_gate -> in_proj_z: Qwen3.5's split
projections), and Qwen3.5's out_proj with its columns' value heads tiled
(its input is tiled to match). Norms, conv kernel, A_log, dt_bias, routers
and the one-row shared_expert_gate stay dense.
"""
import logging
from collections.abc import Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.attention import Attention
from kvcache.spec import LayerSpec, LinearAttentionSpec
from model_zoo import gated_delta
from model_zoo.layers import (PACKED, GemmaRMSNorm, RotaryEmbedding, language_model_weights, load_packed_weights,
                              rope_parameters, use_gguf_blocks)
from model_zoo.llama import LlamaMLP
from model_zoo.qwen3_moe import SparseMoeBlock, is_sparse_layer
from parallel.linear import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, ReplicatedLinear,
                             RowParallelLinear, VocabParallelEmbedding)
from parallel.quant.gguf import QTYPES
from parallel.state import get_tp_rank, get_tp_size

log = logging.getLogger("tqserve.model")


class GatedRMSNorm(nn.Module):
    """w * rms_norm(x), then * silu(z): the DeltaNet output norm, per value head."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def init_dummy(self, generator, low, high):
        self.weight.fill_(1.0)

    def forward(self, x, z):
        xf = x.float()
        y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Tensor parallel by key head (with the value heads it serves): in_proj_qkvz
    and in_proj_ba are grouped per key head, so a contiguous row split is a
    head split; the conv channels (q | k | v, each over all heads), dt_bias
    and A_log are cut to this rank's heads; out_proj is row-parallel."""

    def __init__(self, config: dict, layer_idx: int):
        super().__init__()
        tp = get_tp_size()
        H = config["hidden_size"]
        self.layer_idx = layer_idx
        nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
        if nk % tp:
            raise ValueError(f"linear_num_key_heads ({nk}) is not divisible by the tensor-parallel size ({tp})")
        self.num_k_heads, self.num_v_heads = nk // tp, nv // tp          # this rank's
        self.k_dim, self.v_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
        self.rep = nv // nk
        key_dim, value_dim = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.split = [key_dim, key_dim, value_dim]
        self.conv_kernel = config["linear_conv_kernel_dim"]
        conv_dim = sum(self.split)
        self.in_proj_qkvz = ColumnParallelLinear(H, tp * (2 * key_dim + 2 * value_dim), bias=False)
        self.in_proj_ba = ColumnParallelLinear(H, 2 * nv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.conv1d.weight.requires_grad_(False)
        self.conv1d.weight.weight_loader = partial(self._load_head_cut, sections=self.split)
        for p in (self.dt_bias, self.A_log):
            p.weight_loader = partial(self._load_head_cut, sections=[self.num_v_heads])
        self.norm = GatedRMSNorm(self.v_dim, config.get("rms_norm_eps", 1e-6))
        self.out_proj = RowParallelLinear(tp * value_dim, H, bias=False)
        self.hidden = H
        self.split_qkvz = False     # in_proj_qkvz as a GGUF file's two tensors (use_gguf_layout)
        self.out_tiled = False      # out_proj's input columns in llama.cpp's tiled value-head order

    def use_gguf_layout(self, prefix: str, fmts: dict[str, str]) -> None:
        """The layout of a GGUF file's stored stream (on the meta-built model, before
        use_gguf_blocks; one rank): in_proj_qkvz becomes the two projections a qwen3next
        file stores it as (llama.cpp's converter splits it), in_proj_qkv (q, k and v of
        all heads: the layout _mix reads) and in_proj_z, so their quantized rows need no
        reordering. (They also load a checkpoint's in_proj_qkvz: unmerged_qkvz.)"""
        if get_tp_size() > 1:
            raise ValueError("GGUF blocks in llama.cpp's DeltaNet layout are not split across tensor-parallel "
                             "ranks yet: add --quantization none")
        old = self.in_proj_qkvz.weight
        prev = torch.get_default_dtype()
        torch.set_default_dtype(old.dtype)
        try:
            with torch.device(old.device):
                self.in_proj_qkv = ColumnParallelLinear(self.hidden, sum(self.split), bias=False)
                self.in_proj_z = ColumnParallelLinear(self.hidden, self.split[2], bias=False)
        finally:
            torch.set_default_dtype(prev)
        del self.in_proj_qkvz
        self.split_qkvz = True

    def unmerged_qkvz(self, prefix: str, w: torch.Tensor):
        """A checkpoint's in_proj_qkvz (grouped per key head: [q, k, v, z] each) as the
        split projections' in_proj_qkv and in_proj_z."""
        q, k, v, z = w.view(self.num_k_heads, -1, w.shape[-1]).split(
            [self.k_dim, self.k_dim, self.rep * self.v_dim, self.rep * self.v_dim], dim=1)
        yield f"{prefix}.in_proj_qkv.weight", torch.cat([x.reshape(-1, w.shape[-1]) for x in (q, k, v)])
        yield f"{prefix}.in_proj_z.weight", z.reshape(-1, w.shape[-1])

    def _load_head_cut(self, param, loaded, shard_id=None, *, sections: list[int]):
        """This rank's heads of a per-head parameter, section by section: the q, k, v
        channels (conv, Qwen3.5's in_proj_qkv), or the value heads (dt_bias / A_log)."""
        tp, rank = get_tp_size(), get_tp_rank()
        if loaded.shape[0] != tp * param.shape[0] or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch: expected {(tp * param.shape[0], *param.shape[1:])}, "
                             f"got {tuple(loaded.shape)}")
        full = loaded.split([tp * n for n in sections])
        param.data.copy_(torch.cat([part.narrow(0, rank * n, n) for part, n in zip(full, sections)]))

    def spec(self) -> LinearAttentionSpec:
        return LinearAttentionSpec(self.layer_idx, sum(self.split), self.conv_kernel, self.num_v_heads,
                                   self.k_dim, self.v_dim)

    def _project(self, x):
        """-> q|k|v [T, conv_dim], z [T, Hv * dv], b, a [T, Hv] (this rank's heads)."""
        T = x.shape[0]
        b, a = self.in_proj_ba(x).view(T, self.num_k_heads, -1).split([self.rep, self.rep], dim=-1)
        if self.split_qkvz:
            return self.in_proj_qkv(x), self.in_proj_z(x), b.reshape(T, -1), a.reshape(T, -1)
        q, k, v, z = self.in_proj_qkvz(x).view(T, self.num_k_heads, -1).split(
            [self.k_dim, self.k_dim, self.rep * self.v_dim, self.rep * self.v_dim], dim=-1)
        return (torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1), z.reshape(T, -1),
                b.reshape(T, -1), a.reshape(T, -1))

    def forward(self, x, meta):
        T = x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = self._mix(mixed, g, beta, meta)
        core = self.norm(core.to(x.dtype), z.view(T, self.num_v_heads, self.v_dim))
        if self.out_tiled:      # value heads grouped by key head -> tiled (v0 of every key head, then v1, ...)
            core = core.view(T, self.num_k_heads, self.rep, self.v_dim).transpose(1, 2)
        return self.out_proj(core.reshape(T, -1))

    def _heads(self, y):
        q, k, v = y.split(self.split, dim=-1)
        lead = y.shape[:-1]
        return (q.reshape(*lead, -1, self.k_dim), k.reshape(*lead, -1, self.k_dim),
                v.reshape(*lead, -1, self.v_dim))

    def _mix(self, mixed, g, beta, meta):
        """The conv + delta rule over the step's tokens -> [T, Hv, dv] fp32.
        meta None: one sequence from zero state. Otherwise each sequence
        continues from its slot's checkpoint of the state after its position
        start - 1 (zeros where its first token is in this step): the decodes
        together, one token each, then the longer spans (prefill chunks,
        verifications of drafts): all at once, a token at a time, when they
        have the same length, at most `checkpoints` (a verification step, also
        as a CUDA graph replays it: every sequence 1 + k rows), else each whole.
        Each writes the state after each of its last `checkpoints` positions
        (kvcache/linear_state.py), which is what a rollback of rejected drafts
        resumes from."""
        w = self.conv1d.weight[:, 0]
        C = mixed.shape[1]
        if meta is None:
            y, _ = gated_delta.conv_span(mixed, w, mixed.new_zeros(C, self.conv_kernel - 1, dtype=torch.float32))
            out, _ = gated_delta.chunked(*self._heads(y), g, beta, self._zero_state(mixed.device))
            return out
        cache = meta.kv_caches[self.layer_idx]
        slots, P = cache.slots(meta), cache.checkpoints
        qsl, lens, nd = meta.query_start_loc, meta.seq_lens, meta.num_decodes
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32, device=mixed.device)
        if nd:
            self._rows(cache, slots[:nd], meta.seq_lens_t[:nd] - 1, mixed[:nd, None], g[:nd, None],
                       beta[:nd, None], out[:nd, None])
        a, B, R = qsl[nd], len(lens) - nd, meta.max_query_len
        # Spans of one length: the longest times their count is all their rows.
        if B and R <= P and qsl[-1] - a == R * B:
            self._rows(cache, slots[nd:], meta.seq_lens_t[nd:] - R, mixed[a:].reshape(B, R, -1),
                       g[a:].reshape(B, R, -1), beta[a:].reshape(B, R, -1), out[a:].view(B, R, *out.shape[1:]))
            return out
        for i in range(nd, len(lens)):
            a, e = qsl[i], qsl[i + 1]
            slot, start, n = slots[i], lens[i] - (e - a), e - a
            if start == 0:       # the sequence starts here
                conv0 = mixed.new_zeros(C, self.conv_kernel - 1, dtype=torch.float32)
                rec0 = self._zero_state(mixed.device)
            else:
                conv0, rec0 = cache.conv[slot, (start - 1) % P], cache.recurrent[slot, (start - 1) % P]
            m = min(n, P)
            y, conv1 = gated_delta.conv_span(mixed[a:e], w, conv0, m)
            out[a:e], rec1 = gated_delta.span(*self._heads(y), g[a:e], beta[a:e], rec0, m)
            at = [(start + n - m + j) % P for j in range(m)]
            cache.conv[slot, at], cache.recurrent[slot, at] = conv1, rec1
        return out

    def _rows(self, cache, slots, start, mixed, g, beta, out):
        """B sequences of R rows each, a token at a time (recurrent steps),
        all from device values (a CUDA graph can replay it): sequence b's
        rows are positions start[b] ..; it continues from its slot's state
        after start[b] - 1 (zeros where start[b] <= 0: its first token is
        here, or a pad sequence's) and writes the state after each row.
        mixed [B, R, C], g / beta [B, R, Hv], out [B, R, Hv, dv]."""
        P, w = cache.checkpoints, self.conv1d.weight[:, 0]
        # Gathered copies, zeroed by a device mask: no host branch on the batch's contents.
        keep = (start > 0).to(torch.float32)
        before = (start - 1) % P
        conv = cache.conv[slots, before] * keep[:, None, None]
        rec = cache.recurrent[slots, before] * keep[:, None, None, None]
        for r in range(mixed.shape[1]):
            y = gated_delta.conv_step(mixed[:, r], w, conv)
            out[:, r] = gated_delta.recurrent_step(*self._heads(y), g[:, r], beta[:, r], rec)
            at = (start + r) % P
            cache.conv[slots, at], cache.recurrent[slots, at] = conv, rec

    def _zero_state(self, device):
        return torch.zeros(self.num_v_heads, self.k_dim, self.v_dim, dtype=torch.float32, device=device)


class SplitProjectionDeltaNet(GatedDeltaNet):
    """Qwen3.5's DeltaNet: the same layer with its input projections apart and
    flat (in_proj_qkv as q | k | v over all heads, in_proj_z, in_proj_b,
    in_proj_a per value head) rather than grouped per key head."""

    def __init__(self, config: dict, layer_idx: int):
        super().__init__(config, layer_idx)
        del self.in_proj_qkvz, self.in_proj_ba
        H, tp, nv = config["hidden_size"], get_tp_size(), config["linear_num_value_heads"]
        self.in_proj_qkv = ColumnParallelLinear(H, tp * sum(self.split), bias=False)
        self.in_proj_qkv.weight.weight_loader = partial(self._load_head_cut, sections=self.split)
        self.in_proj_z = ColumnParallelLinear(H, nv * self.v_dim, bias=False)
        self.in_proj_b = ColumnParallelLinear(H, nv, bias=False)
        self.in_proj_a = ColumnParallelLinear(H, nv, bias=False)

    def _project(self, x):
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def use_gguf_layout(self, prefix: str, fmts: dict[str, str]) -> None:
        """The layout of a GGUF file's stored stream (call before use_gguf_blocks; one rank):
        in_proj_qkv loads whole (its head cut is for tensor parallelism), and an out_proj
        kept as blocks has the columns llama.cpp wrote, value heads tiled when they
        outnumber the key heads (a reorder inside the blocks the loader cannot undo):
        forward tiles out_proj's input the same way."""
        if get_tp_size() > 1:
            raise ValueError("GGUF blocks in llama.cpp's DeltaNet layout are not split across tensor-parallel "
                             "ranks yet: add --quantization none")
        self.in_proj_qkv.weight.weight_loader = self.in_proj_qkv.weight_loader
        self.out_tiled = self.rep > 1 and f"{prefix}.out_proj.weight" in fmts


class GatedAttention(nn.Module):
    def __init__(self, config: dict, layer_idx: int, head_dim: int, rope: RotaryEmbedding):
        super().__init__()
        H, nh = config["hidden_size"], config["num_attention_heads"]
        nkv = config.get("num_key_value_heads") or nh
        bias = config.get("attention_bias", False)
        eps = config.get("rms_norm_eps", 1e-6)
        # Each head's query and output gate are adjacent rows: as 2 * nh heads of head_dim
        # they split over tensor-parallel ranks like plain heads.
        self.qkv_proj = QKVParallelLinear(H, head_dim, 2 * nh, nkv, bias=bias)
        self.o_proj = RowParallelLinear(nh * head_dim, H, bias=bias)
        self.q_norm, self.k_norm = GemmaRMSNorm(head_dim, eps), GemmaRMSNorm(head_dim, eps)
        self.head_dim, self.rotary = head_dim, rope
        self.attn = Attention(self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads, head_dim,
                              head_dim ** -0.5, layer_idx)

    def forward(self, positions, x, meta):
        T, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = qg.view(T, -1, 2 * d).chunk(2, dim=-1)
        q, k = self._rope(positions, self.q_norm(q), self.k_norm(k.view(T, -1, d)))
        o = self.attn(q.reshape(T, -1), k.reshape(T, -1), v, meta)
        return self.o_proj(o * torch.sigmoid(gate.reshape(T, -1)))

    def _rope(self, positions, q, k):
        """Rotary on each head's first rotary.head_dim features; the rest pass."""
        r, T = self.rotary.head_dim, q.shape[0]
        qr, kr = self.rotary(positions, q[..., :r].reshape(T, -1), k[..., :r].reshape(T, -1))
        return (torch.cat((qr.view(T, -1, r), q[..., r:]), dim=-1),
                torch.cat((kr.view(T, -1, r), k[..., r:]), dim=-1))


class SharedExpertMoeBlock(SparseMoeBlock):
    def __init__(self, config: dict):
        super().__init__(config)
        H = config["hidden_size"]
        self.shared_expert = LlamaMLP(H, config["shared_expert_intermediate_size"], False,
                                      config.get("hidden_act", "silu"))
        self.shared_expert_gate = ReplicatedLinear(H, 1, bias=False)

    def forward(self, x):
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: dict, layer_idx: int, kind: str, linear_attn: type[GatedDeltaNet],
                 attn: "GatedAttention | None", mlp: nn.Module):
        super().__init__()
        H, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.linear = kind == "linear_attention"
        if self.linear:
            self.linear_attn = linear_attn(config, layer_idx)
        elif kind == "full_attention":
            self.self_attn = attn
        else:
            raise ValueError(f"layer {layer_idx}: unsupported layer type {kind!r} "
                             f"(supported: linear_attention, full_attention)")
        self.mlp = mlp
        self.input_layernorm, self.post_attention_layernorm = GemmaRMSNorm(H, eps), GemmaRMSNorm(H, eps)

    def forward(self, positions, x, meta):
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, meta) if self.linear else self.self_attn(positions, h, meta))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextMTP(nn.Module):
    """The MTP head (checkpoint `mtp.*`, as vLLM's Qwen3NextMultiTokenPredictor
    reads it): the target's final (normed) hidden state at position p and the
    embedding of token p + 1, each normed, joined by fc, one full-attention
    decoder layer (its KV is pool layer num_hidden_layers) and a final norm;
    the shared LM head then predicts token p + 2. Its output stands in for the
    target's hidden state when drafts chain."""

    def __init__(self, config: dict, layer: Qwen3NextDecoderLayer):
        super().__init__()
        H, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = GemmaRMSNorm(H, eps), GemmaRMSNorm(H, eps)
        self.fc = ReplicatedLinear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([layer])
        self.norm = GemmaRMSNorm(H, eps)

    def forward(self, embeds, hidden, positions, meta):
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
        return self.norm(self.layers[0](positions, x, meta))


def layer_types(config: dict) -> list[str]:
    n = config["num_hidden_layers"]
    every = config.get("full_attention_interval", 4)
    return config.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]


class Qwen3NextModel(nn.Module):
    def __init__(self, config: dict, layers: list[Qwen3NextDecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)


class Qwen3NextForCausalLM(nn.Module):
    linear_attn_class: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        H, nh = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or H // nh
        rope = rope_parameters(config)
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
        rotary = RotaryEmbedding(int(head_dim * factor), rope)
        self.head_dim = head_dim
        layers = [Qwen3NextDecoderLayer(config, i, kind, self.linear_attn_class,
                                        GatedAttention(config, i, head_dim, rotary) if kind == "full_attention"
                                        else None, self._mlp(config, i))
                  for i, kind in enumerate(layer_types(config))]
        self.model = Qwen3NextModel(config, layers)
        n_mtp = config.get("mtp_num_hidden_layers", config.get("num_nextn_predict_layers", 0))
        if n_mtp > 1:
            raise ValueError(f"{n_mtp} MTP layers: only one (mtp_num_hidden_layers 1, as released) is supported")
        self.has_mtp, self.mtp_loaded = n_mtp == 1, False
        if self.has_mtp:
            i = config["num_hidden_layers"]
            self.mtp = Qwen3NextMTP(config, Qwen3NextDecoderLayer(
                config, i, "full_attention", self.linear_attn_class, GatedAttention(config, i, head_dim, rotary),
                self._mlp(config, i)))
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)
        self.lm_head = ParallelLMHead(config["vocab_size"], H)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _mlp(self, config: dict, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SharedExpertMoeBlock(config)
        return LlamaMLP(config["hidden_size"], config["intermediate_size"], False, config.get("hidden_act", "silu"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # What an MTP proposer calls (engine/mtp_proposer.py): here the "streams"
    # are the final hidden states themselves.
    forward_streams = forward

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        return streams

    mtp_collapse = collapse

    @property
    def stream_shape(self) -> tuple[int, ...]:
        """One row of what forward_streams returns and mtp_streams takes."""
        return (self.config["hidden_size"],)

    def mtp_streams(self, next_ids, hidden, positions, attn_metadata):
        """Draft hidden states: next_ids[i] is the token after position
        positions[i], hidden[i] the target's final hidden state there."""
        return self.mtp(self.model.embed_tokens(next_ids), hidden, positions, attn_metadata)

    def mtp_cache_spec(self) -> list[LayerSpec]:
        layer = self.mtp.layers[0]
        return [LayerSpec(layer.self_attn.attn.layer_idx, layer.self_attn.attn.num_kv_heads, self.head_dim)]

    def use_stored(self, fmts: dict[str, str]) -> int:
        """Layers fed by these checkpoint tensors ({name: GGUF type}, a GGUF file's) keep
        their GGUF rows; the DeltaNet layers take the file's layout (GatedDeltaNet.
        use_gguf_layout). Call on the meta-built model; returns how many layers keep rows."""
        other = sorted({f for f in fmts.values() if f not in QTYPES})
        if other:
            raise ValueError(f"{type(self).__name__} keeps GGUF blocks only, not {', '.join(other)}")
        for name, m in self.named_modules():
            if isinstance(m, GatedDeltaNet):
                m.use_gguf_layout(name, fmts)
        n = use_gguf_blocks(self, fmts, PACKED)
        if self.tie_word_embeddings:       # the head reads the embedding's storage
            self.lm_head.weight, self.lm_head.quant = self.model.embed_tokens.weight, self.model.embed_tokens.quant
        return n

    def _split_qkvz(self, weights):
        """With split DeltaNet projections (use_stored): a checkpoint's in_proj_qkvz as them."""
        modules = dict(self.named_modules())
        for name, t in weights:
            prefix, _, leaf = name.rpartition(".in_proj_qkvz.")
            layer = modules.get(prefix) if leaf == "weight" and isinstance(t, torch.Tensor) else None
            if getattr(layer, "split_qkvz", False):
                yield from layer.unmerged_qkvz(prefix, t)
            else:
                yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skipped = []    # a vision tower; the MTP head when the config has none
        ignore = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tie_word_embeddings else ())
        skip = ("model.visual.",) + (() if self.has_mtp else ("mtp.",))
        seen = load_packed_weights(self, self._split_qkvz(language_model_weights(weights, skip, skipped)), PACKED,
                                   ignore, optional=("mtp.",))
        self.mtp_loaded = any(n.startswith("mtp.") for n in seen)
        if skipped:
            log.info("%s: %d vision / MTP-head tensors not loaded (text only)", type(self).__name__, len(skipped))

    def kv_cache_spec(self) -> list:
        return [layer.linear_attn.spec() if layer.linear else
                LayerSpec(i, layer.self_attn.attn.num_kv_heads, self.head_dim)
                for i, layer in enumerate(self.model.layers)]


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense): Qwen3-Next's layers with split DeltaNet projections and a
    dense MLP in every layer. Its rotary is multimodal (mrope), which for text
    (one position on every axis) is the plain partial rotary used here."""
    linear_attn_class = SplitProjectionDeltaNet

    def _mlp(self, config: dict, layer_idx: int) -> nn.Module:
        return LlamaMLP(config["hidden_size"], config["intermediate_size"], False, config.get("hidden_act", "silu"))


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE: split DeltaNet projections, every layer a shared-expert MoE
    whose router always renormalises its top k."""
    linear_attn_class = SplitProjectionDeltaNet

    def _mlp(self, config: dict, layer_idx: int) -> nn.Module:
        return SharedExpertMoeBlock(dict(config, norm_topk_prob=True))
