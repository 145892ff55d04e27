"""The one place that holds both the model and the scheduler's view: builds
flat batch metadata for a scheduled step, runs one forward over the mixed
prefill + decode batch, and samples."""
import torch

from engine.request import Request
from engine.sampler import sample, token_logprobs
from engine.scheduler import SchedulerOutput, ScheduledRequest
from kvcache.dsv4_paged import DSV4PagedCache
from kvcache.kv_manager import KVCacheManager
from kvcache.metadata import AttentionMetadata, GroupMetadata


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, kv_caches: list):
        self.model = model
        self.kv = kv
        self.kv_caches = kv_caches     # indexed by layer, or one DSV4PagedCache

    def _build_dsv4(self, sched: list[ScheduledRequest]):
        """Stateful (DeepSeek-V4) pool: the metadata is per-sequence views of it."""
        input_ids, positions, qsl, seqs = [], [], [0], []
        for s in sched:
            req, start, n = s.req, s.req.num_computed_tokens, s.num_new_tokens
            input_ids.extend(req.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            qsl.append(qsl[-1] + n)
            seqs.append((start, [self.kv.block_table(req.request_id, g) for g in range(len(self.kv.groups))]))
        return (torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                self.kv_caches.batch(seqs, qsl), qsl)

    def _build(self, sched: list[ScheduledRequest]):
        if isinstance(self.kv_caches, DSV4PagedCache):
            return self._build_dsv4(sched)
        bs = self.kv.block_size
        input_ids, positions, qsl, seq_lens = [], [], [0], []
        slots = [[] for _ in self.kv.groups]
        tables = [[] for _ in self.kv.groups]
        for s in sched:
            req, start, n = s.req, s.req.num_computed_tokens, s.num_new_tokens
            input_ids.extend(req.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            for g in range(len(self.kv.groups)):
                table = self.kv.block_table(req.request_id, g)
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
                tables[g].append(table)
        groups = []
        for g in range(len(self.kv.groups)):
            width = max(len(t) for t in tables[g])
            bt = torch.zeros(len(sched), width, dtype=torch.long)
            for i, t in enumerate(tables[g]):
                row = torch.tensor(t, dtype=torch.long)
                bt[i, :len(t)] = row.clamp(min=0)   # NULL_BLOCK -> 0, masked by position
            groups.append(GroupMetadata(torch.tensor(slots[g], dtype=torch.long), bt))
        num_decodes = 0
        while num_decodes < len(sched) and sched[num_decodes].num_new_tokens == 1:
            num_decodes += 1
        meta = AttentionMetadata(qsl, seq_lens, num_decodes, groups, self.kv_caches)
        return (torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                meta, qsl)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, dict | None]]:
        """Run one step. Returns {request_id: (token, logprobs)} for requests
        whose step reached the end of their known tokens; fills prompt
        logprobs on the request objects as a side effect."""
        # Decodes first, as the attention metadata expects.
        sched = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta, qsl = self._build(sched)
        hidden = self.model(input_ids, positions, meta)
        rows, sampled = [], []
        for i, s in enumerate(sched):
            req = s.req
            if req.prompt_logprobs is not None and s.start < req.num_prompt_tokens:
                self._prompt_logprobs(req, s, hidden[qsl[i]:qsl[i + 1]])
            if s.start + s.num_new_tokens == req.num_tokens:
                rows.append(qsl[i + 1] - 1)
                sampled.append(req)
        if not sampled:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        tokens, lps = sample(logits, sampled)
        return {r.request_id: (t, lp) for r, t, lp in zip(sampled, tokens, lps)}

    def _prompt_logprobs(self, req: Request, s: ScheduledRequest, hidden: torch.Tensor) -> None:
        # Position p predicts token p + 1; only prompt tokens are scored.
        end = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
        n = end - s.start
        if n <= 0:
            return
        logp = torch.log_softmax(self.model.compute_logits(hidden[:n]).float(), dim=-1)
        k = req.params.prompt_logprobs
        for j in range(n):
            if len(req.prompt_logprobs) != s.start + j + 1:   # already scored before a preemption
                continue
            req.prompt_logprobs.append(token_logprobs(logp[j], req.token_ids[s.start + j + 1], k))
