"""Drafts from a model's MTP head (multi-token prediction): DeepSeek-V4's,
Qwen3-Next's / Qwen3.5's.

The head reads the target's hidden state at position p (DeepSeek-V4: its
pre-collapse streams) and the embedding of token p + 1, and predicts token
p + 2. Its own cache (DeepSeek-V4: a sliding-window ring per sequence in the
sequence's state slot, kvcache/dsv4_paged.py mtp_batch; Qwen3-Next: a
full-attention layer in the paged pool, sharing the model's block tables;
ModelRunner.mtp_metadata) must see every position the target keeps,
so after each step the head runs over the positions whose KV stayed (prefill
chunks too, drafting or not); the last of them gives the first draft. Further
drafts chain, as vLLM chains MTP: the head's own output streams stand in for
the target's at the next position, fed the draft before. Those chained
positions are rolled back by the next step, which starts the head at the
sequence's computed length again (the ring keeps max_rollback extra
positions; a paged head's blocks for them are reserved, as the next step's
verification needs them). Drafts are the argmax: deterministic, so verification treats
them as one-hot. On CUDA the chained passes (one row per sequence) replay
CUDA graphs captured at startup (ModelRunner.mtp_replay); the first pass,
whose spans vary, runs eagerly.

With prefix caching, the step's state snapshots are taken after the first
pass (ModelRunner.snapshot_after_head), so that they hold the head's ring
too; a request the step finished still gets that pass. What the head cached
at position p read token p + 1, so blocks and snapshots are hashed with the
token after them (KVCacheManager lookahead) and a hit resumes the head's
cache exactly where it would be without one."""
import numpy as np
import torch

from engine.request import Request, Status
from engine.speculative import Proposer


class MtpProposer(Proposer):
    def __init__(self, runner):
        self.runner = runner      # its model has an MTP head (the worker checked at load)
        runner.keep_streams = True

    def _tables(self, req: Request) -> list[np.ndarray]:
        kv = self.runner.kv
        return [kv.block_table_array(req.request_id, g) for g in range(len(kv.groups))]

    def _run(self, ids: list[int], streams: torch.Tensor, pos: list[int], seqs: list, qsl: list[int]):
        dev = self.runner.device
        return self.runner.model.mtp_streams(torch.tensor(ids, dtype=torch.long, device=dev), streams,
                                             torch.tensor(pos, dtype=torch.long, device=dev),
                                             self.runner.mtp_metadata(seqs, qsl))

    def _argmax(self, h: torch.Tensor) -> list[int]:
        model = self.runner.model
        return model.compute_logits(model.mtp_collapse(h)).argmax(dim=-1).tolist()

    def _reserve(self, req: Request, k: int) -> int:
        """Blocks for the positions chained drafts write (computed length ..
        + k - 2; the next step verifies there anyway). Returns the drafts
        the pool has room for."""
        if k > 1 and not self.runner.reserve_mtp_positions(req, k - 1):
            return 1
        return k

    @torch.inference_mode()
    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        step, self.runner.last_step = self.runner.last_step, None
        if step is None:
            return [[] for _ in reqs]
        h, last = self._follow(step)
        self.runner.snapshot_after_head(step)
        return self._draft(reqs, max_drafts, h, last)

    def _follow(self, step) -> tuple[torch.Tensor | None, dict[str, int]]:
        """1. The head over each request's kept positions (a request this step
        finished too: its last step's blocks and snapshots are cached), true
        streams; sequences of one position first, as attention metadata lays
        them out. Returns the head's output streams and, per request, the row
        of its last position."""
        spans = []
        for i, s in enumerate(step.sched):
            # Up to the last position whose next token is known (a prompt-only request has none).
            kept = min(s.req.num_computed_tokens, s.req.num_tokens - 1) - s.start
            if s.req.status == Status.RUNNING and kept > 0:
                spans.append((kept != 1, i, s, kept))
        if not spans:
            return None, {}
        ids, rows, pos, seqs, qsl, last = [], [], [], [], [0], {}
        for _, i, s, kept in sorted(spans, key=lambda x: x[:2]):
            req, a = s.req, step.query_start_loc[i]
            rows.extend(range(a, a + kept))
            ids.extend(req.token_ids[s.start + 1:s.start + kept + 1])
            pos.extend(range(s.start, s.start + kept))
            seqs.append((s.start, self._tables(req)))
            qsl.append(qsl[-1] + kept)
            last[req.request_id] = qsl[-1] - 1
        rows_t = torch.tensor(rows, dtype=torch.long, device=step.streams.device)
        return self._run(ids, step.streams.index_select(0, rows_t), pos, seqs, qsl), last

    def _draft(self, reqs: list[Request], max_drafts: list[int], h: torch.Tensor | None, last: dict[str, int]
               ) -> list[list[int]]:
        """2. Drafts: the first from the last kept position, then chained."""
        todo = [(i, r, self._reserve(r, k)) for i, (r, k) in enumerate(zip(reqs, max_drafts))
                if k > 0 and r.request_id in last]
        out = [[] for _ in reqs]
        if not todo:
            return out
        hs = h[[last[r.request_id] for _, r, _ in todo]]
        for j, t in enumerate(self._argmax(hs)):
            out[todo[j][0]].append(t)
        tables = {r.request_id: self._tables(r) for _, r, k in todo if k > 1}
        for step_j in range(1, max(k for _, _, k in todo)):
            sel = [n for n, (_, _, k) in enumerate(todo) if k > step_j]
            todo, hs = [todo[n] for n in sel], hs[sel]
            # Position c + step_j - 1 (c: computed length) gets the previous draft.
            starts = [r.num_computed_tokens + step_j - 1 for _, r, _ in todo]
            ids, tabs = [out[i][-1] for i, _, _ in todo], [tables[r.request_id] for _, r, _ in todo]
            # One row per sequence: a CUDA graph's replay where one was captured.
            h = self.runner.mtp_replay(ids, hs, starts, tabs)
            hs = h if h is not None else self._run(ids, hs, starts, list(zip(starts, tabs)),
                                                   list(range(len(todo) + 1)))
            for (i, _, _), t in zip(todo, self._argmax(hs)):
                out[i].append(t)
        return out
