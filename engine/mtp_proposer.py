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

Under tensor parallelism the leader broadcasts each call's passes
(HeadPlan) after the step's plan, and every rank runs them (run_head).

With prefix caching, the step's state snapshots are taken after the first
pass (ModelRunner.snapshot_after_head), so that they hold the head's ring
too; a request the step finished still gets that pass. What the head cached
at position p read token p + 1, so blocks and snapshots are hashed with the
token after them (KVCacheManager lookahead) and a hit resumes the head's
cache exactly where it would be without one."""
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.request import Request, Status
from engine.speculative import Proposer


@dataclass
class HeadPlan:
    """One proposer call's MTP head passes as data. The leader builds it from
    its requests and block tables (MtpProposer); under tensor parallelism it
    is broadcast after the step, and every rank runs it (run_head), whose
    collectives pair up. Chained drafts need no more messages: each rank
    takes the argmax of the same gathered logits."""
    ids: list[int]                   # first pass: the token after each kept position
    rows: list[int]                  # ... its row in the step's streams
    pos: list[int]
    seqs: list[tuple[int, list[np.ndarray]]]   # (first position, block tables) per sequence
    qsl: list[int]
    last: list[int] = field(default_factory=list)     # per drafting request: its last row in the first pass
    drafts: list[int] = field(default_factory=list)   # ... how many tokens it drafts
    starts: list[int] = field(default_factory=list)   # ... its computed length
    tables: list[list[np.ndarray] | None] = field(default_factory=list)   # ... block tables (chained passes)


def _run(runner, ids: list[int], streams: torch.Tensor, pos: list[int], seqs: list, qsl: list[int]):
    dev = runner.device
    return runner.model.mtp_streams(torch.tensor(ids, dtype=torch.long, device=dev), streams,
                                    torch.tensor(pos, dtype=torch.long, device=dev), runner.mtp_metadata(seqs, qsl))


def _argmax(runner, h: torch.Tensor) -> list[int]:
    model = runner.model
    return model.compute_logits(model.mtp_collapse(h)).argmax(dim=-1).tolist()


@torch.inference_mode()
def run_head(runner, plan: HeadPlan) -> list[list[int]]:
    """What every rank runs after a step: the head over the kept positions
    (the step's streams, runner.last_step), the step's state snapshots
    (ModelRunner.snapshot_after_head), then the drafts: the first from each
    drafting request's last kept position, further ones chained. Returns the
    drafts, per drafting request of the plan."""
    step, runner.last_step = runner.last_step, None
    h = None
    if plan.rows:
        rows = torch.tensor(plan.rows, dtype=torch.long, device=step.streams.device)
        h = _run(runner, plan.ids, step.streams.index_select(0, rows), plan.pos, plan.seqs, plan.qsl)
    if step is not None:
        runner.snapshot_after_head(step)
    if not plan.last:
        return []
    hs = h[plan.last]
    out = [[t] for t in _argmax(runner, hs)]
    todo = list(range(len(plan.last)))
    for j in range(1, max(plan.drafts)):
        sel = [n for n, i in enumerate(todo) if plan.drafts[i] > j]
        todo, hs = [todo[n] for n in sel], hs[sel]
        # Position c + j - 1 (c: computed length) gets the previous draft.
        starts = [plan.starts[i] + j - 1 for i in todo]
        ids, tabs = [out[i][-1] for i in todo], [plan.tables[i] for i in todo]
        # One row per sequence: a CUDA graph's replay where one was captured.
        h = runner.mtp_replay(ids, hs, starts, tabs)
        hs = h if h is not None else _run(runner, ids, hs, starts, list(zip(starts, tabs)),
                                          list(range(len(todo) + 1)))
        for i, t in zip(todo, _argmax(runner, hs)):
            out[i].append(t)
    return out


class MtpProposer(Proposer):
    def __init__(self, runner):
        self.runner = runner      # its model has an MTP head (the worker checked at load)
        runner.keep_streams = True

    def _tables(self, req: Request) -> list[np.ndarray]:
        kv = self.runner.kv
        return [kv.block_table_array(req.request_id, g) for g in range(len(kv.groups))]

    def _reserve(self, req: Request, k: int) -> int:
        """Blocks for the positions chained drafts write (computed length ..
        + k - 2; the next step verifies there anyway). Returns the drafts
        the pool has room for."""
        if k > 1 and not self.runner.reserve_mtp_positions(req, k - 1):
            return 1
        return k

    def plan(self, step, reqs: list[Request], max_drafts: list[int]) -> tuple[HeadPlan, list[int]]:
        """The head's passes for this call, and which of reqs draft (in the plan's order)."""
        # The head over each request's kept positions (a request this step
        # finished too: its last step's blocks and snapshots are cached);
        # sequences of one position first, as attention metadata lays them out.
        spans = []
        for i, s in enumerate(step.sched):
            # Up to the last position whose next token is known (a prompt-only request has none).
            kept = min(s.req.num_computed_tokens, s.req.num_tokens - 1) - s.start
            if s.req.status == Status.RUNNING and kept > 0:
                spans.append((kept != 1, i, s, kept))
        plan, last = HeadPlan([], [], [], [], [0]), {}
        for _, i, s, kept in sorted(spans, key=lambda x: x[:2]):
            req, a = s.req, step.query_start_loc[i]
            plan.rows.extend(range(a, a + kept))
            plan.ids.extend(req.token_ids[s.start + 1:s.start + kept + 1])
            plan.pos.extend(range(s.start, s.start + kept))
            plan.seqs.append((s.start, self._tables(req)))
            plan.qsl.append(plan.qsl[-1] + kept)
            last[req.request_id] = plan.qsl[-1] - 1
        who = []
        for i, (r, k) in enumerate(zip(reqs, max_drafts)):
            if k > 0 and r.request_id in last:
                k = self._reserve(r, k)
                who.append(i)
                plan.last.append(last[r.request_id])
                plan.drafts.append(k)
                plan.starts.append(r.num_computed_tokens)
                plan.tables.append(self._tables(r) if k > 1 else None)
        return plan, who

    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        step = self.runner.last_step
        if step is None:
            return [[] for _ in reqs]
        plan, who = self.plan(step, reqs, max_drafts)
        followers = self.runner.followers
        if followers is None:
            drafts = run_head(self.runner, plan)
        else:
            with followers.lock:        # no heartbeat between the plan and its collectives
                followers.send(plan)
                drafts = run_head(self.runner, plan)
        out = [[] for _ in reqs]
        for i, d in zip(who, drafts):
            out[i] = d
        return out
