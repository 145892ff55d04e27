"""Speculative decoding with a draft model (vLLM's `speculative_config`
{"model": path, "num_speculative_tokens": k}): a smaller model of the same
vocabulary drafts k tokens greedily, the target verifies them in its next
step (engine/speculative.py: drafts are one-hot, so the output is the
target's distribution, greedy or sampled).

The draft keeps its own paged KV cache, dense in the model dtype, every
layer in one group of blocks handed out here (a sliding-window layer reads
its window from the full table). Its share of the KV budget is its bytes
per token over both models' (Worker._init_kv_caches), so it holds as many
tokens as the target's pool. Each proposer call runs the draft over what it
has not seen of each request (the prompt the first time, in chunks of
CATCH_UP_CHUNK tokens, then the tokens accepted since, the target's own
included) and takes the argmax at the last position, then chains k - 1
single-token passes on its own drafts; only the verified prefix counts as
computed, so a rejected draft's KV is simply written over next time. A request it has no blocks for drafts nothing this
step; requests that leave the running set free theirs (retain).

Runs on the leader's device, eagerly; not with tensor parallelism (the
draft's layers would shard and need every rank).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.request import Request
from engine.speculative import Proposer
from kvcache.metadata import AttentionMetadata, GroupMetadata
from kvcache.pool_plan import make_layer_cache

log = logging.getLogger("tqserve.engine")

# The most tokens one catch-up pass feeds the draft (a long prompt goes in
# chunks of this, as the target's own prefill does, bounding activations).
CATCH_UP_CHUNK = 2048


class DraftModel:
    """The draft model and (once allocated) its KV caches."""

    def __init__(self, model: torch.nn.Module, config: dict, dtype: torch.dtype, block_size: int,
                 device: torch.device):
        self.model, self.config, self.dtype, self.block_size, self.device = model, config, dtype, block_size, device
        self.specs = model.kv_cache_spec()
        bad = [s for s in self.specs if s.per_seq or not hasattr(s, "num_kv_heads")]
        if bad or not self.specs:
            raise ValueError(f"speculative draft model {config.get('model_type')!r}: only paged attention layers "
                             "can draft (no linear-attention state, not DeepSeek-V4's pool)")
        self.num_layers = max(s.layer_idx for s in self.specs) + 1
        self.caches: list | None = None
        self.num_blocks = 0

    @property
    def bytes_per_token(self) -> float:
        probe = sum(make_layer_cache(s, 1, self.block_size, self.dtype, 0, self.num_layers).nbytes
                    for s in self.specs)
        return probe / self.block_size

    def allocate(self, budget_bytes: int) -> None:
        """Blocks for budget_bytes (block 0 is the pad rows' and unused table entries')."""
        self.num_blocks = max(2, int(budget_bytes // (self.bytes_per_token * self.block_size)))
        caches = [None] * self.num_layers
        for s in self.specs:
            caches[s.layer_idx] = make_layer_cache(s, self.num_blocks, self.block_size, self.dtype, 0,
                                                   self.num_layers, device=self.device)
        self.caches = caches

    def pool_tensors(self) -> list[torch.Tensor]:
        return [t for c in self.caches or [] if c is not None for t in c.pool_tensors()]


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    computed: int = 0           # tokens of the request whose KV the draft holds


class DraftModelProposer(Proposer):
    def __init__(self, draft: DraftModel, vocab_size: int):
        self.d = draft
        self.vocab_size = vocab_size
        self.free = list(range(draft.num_blocks - 1, 0, -1))     # block 0 stays the pad block
        self.seqs: dict[str, _Seq] = {}

    def retain(self, request_ids: set[str]) -> None:
        for rid in [r for r in self.seqs if r not in request_ids]:
            self.free += self.seqs.pop(rid).blocks

    def _room(self, seq: _Seq, tokens: int) -> bool:
        need = -(-tokens // self.d.block_size) - len(seq.blocks)
        if need > len(self.free):
            return False
        seq.blocks += [self.free.pop() for _ in range(max(0, need))]
        return True

    @torch.inference_mode()
    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        todo = []
        for i, (r, k) in enumerate(zip(reqs, max_drafts)):
            seq = self.seqs.setdefault(r.request_id, _Seq())
            # Positions up to num_tokens + k - 2 get written (the last draft is never fed back).
            if k > 0 and self._room(seq, r.num_tokens + k - 1):
                todo.append(i)
        if not todo:
            return out
        # The first pass: each request's unseen tokens; its last row's argmax is the first draft.
        spans = []
        for i in todo:
            r, seq = reqs[i], self.seqs[reqs[i].request_id]
            first = min(seq.computed, r.num_tokens - 1)
            toks = r.token_array[first:r.num_tokens].tolist()
            while len(toks) > CATCH_UP_CHUNK:
                self._forward([(seq, first, toks[:CATCH_UP_CHUNK])])
                first, toks = first + CATCH_UP_CHUNK, toks[CATCH_UP_CHUNK:]
            spans.append((seq, first, toks))
        for i, t in zip(todo, self._forward(spans)):
            out[i].append(t)
            self.seqs[reqs[i].request_id].computed = reqs[i].num_tokens
        # Chained passes: one row per request, fed its previous draft.
        for j in range(1, max(max_drafts[i] for i in todo)):
            live = [i for i in todo if max_drafts[i] > j]
            spans = [(self.seqs[reqs[i].request_id], reqs[i].num_tokens + j - 1, [out[i][-1]]) for i in live]
            for i, t in zip(live, self._forward(spans)):
                out[i].append(t)
        return out

    def _forward(self, spans: list[tuple[_Seq, int, list[int]]]) -> list[int]:
        """Run the draft over spans (sequence, first position, tokens), one-token
        spans first as the metadata lays out decodes; the argmax at each span's
        last row, in the spans' order."""
        order = sorted(range(len(spans)), key=lambda n: len(spans[n][2]) != 1)
        bs, dev = self.d.block_size, self.d.device
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        tables = torch.zeros(len(spans), max(len(s[0].blocks) for s in spans), dtype=torch.long)
        for b, n in enumerate(order):
            seq, first, toks = spans[n]
            tables[b, :len(seq.blocks)] = torch.tensor(seq.blocks)
            ids += toks
            pos += range(first, first + len(toks))
            slots += [seq.blocks[p // bs] * bs + p % bs for p in range(first, first + len(toks))]
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(first + len(toks))
        md = AttentionMetadata(qsl, seq_lens, sum(len(s[2]) == 1 for s in spans),
                               [GroupMetadata(torch.tensor(slots, dtype=torch.long, device=dev), tables.to(dev))],
                               self.d.caches, seq_lens_t=torch.tensor(seq_lens, dtype=torch.long, device=dev),
                               query_start_loc_t=torch.tensor(qsl, dtype=torch.long, device=dev))
        model = self.d.model
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        # A target's image placeholders may lie past the draft's vocabulary (the
        # draft reads text only): it sees id 0 there.
        ids_t = ids_t.masked_fill(ids_t >= int(self.d.config["vocab_size"]), 0)
        hidden = model(ids_t, torch.tensor(pos, dtype=torch.long, device=dev), md)
        last = torch.tensor(qsl[1:], dtype=torch.long, device=dev) - 1
        tokens = model.compute_logits(hidden.index_select(0, last))[:, :self.vocab_size].argmax(dim=-1).tolist()
        back = [0] * len(spans)
        for b, n in enumerate(order):
            back[n] = tokens[b]
        return back
