"""Tensor-parallel ranks other than 0, and the leader's line to them.

Rank 0 (the engine core) schedules and samples; the other ranks only run the
model. Every step the leader broadcasts the step's plan (model_runner.StepPlan:
token ids, positions, block tables, logits rows; sampling stays on rank 0)
over the TP group, and every rank runs the same forward, whose collectives
pair up; with an MTP proposer, then the head's passes (mtp_proposer.HeadPlan).
Under asynchronous scheduling a step's ids may still be sampling on
rank 0's device when its plan goes out: the leader shares each step's
sampled tokens in one all-reduce after it (Followers.share), and each
follower's next step reads them on its own device. While idle the leader
broadcasts a heartbeat every quarter of the distributed timeout, so a
follower that hears nothing for the whole timeout knows the leader is gone
or hung and exits non-zero; at shutdown it sends STOP.

One node: the leader's process starts the node's other ranks (start_local_ranks).
Other nodes: `tqserve serve --headless --node-rank R ...` runs that node's
ranks (run_headless) and exits when the leader stops.
"""
import logging
import multiprocessing as mp
import sys
import threading
import time
from dataclasses import dataclass

import torch

from engine.core_process import die_with_parent
from engine.engine_args import EngineArgs
from parallel import distributed
from parallel.state import all_reduce, broadcast_object, ping

log = logging.getLogger("tqserve.engine")

HEARTBEAT, STOP = "heartbeat", "stop"


@dataclass(frozen=True)
class Sleep:
    """The leader's sleep(level) (engine/sleep_mode.py), for every rank."""
    level: int


@dataclass(frozen=True)
class WakeUp:
    """The leader's wake_up(tags), for every rank."""
    tags: tuple[str, ...]


class Followers:
    """The leader's side: one broadcast per step plan, heartbeats while idle.

    `lock` is held for a whole step (plan, then the forward's collectives),
    so a heartbeat from the timer thread never lands between them; nor
    between a plan that promises its sampled tokens and their share()."""

    def __init__(self, timeout_s: float, device: torch.device):
        distributed.startup_done()
        self.lock = threading.Lock()
        self.interval = timeout_s / 4
        self.last = time.monotonic()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.device = device
        self.owed = 0                  # tokens a sent plan promised, not shared yet
        self._thread = threading.Thread(target=self._beat, name="tqserve-tp-heartbeat", daemon=True)
        self._thread.start()

    def send(self, msg) -> None:
        """Broadcast msg (call with lock held)."""
        broadcast_object(msg)
        self.last = time.monotonic()

    def send_plan(self, plan) -> None:
        """Broadcast a step's plan (call with lock held)."""
        self.send(plan)
        self.owed = plan.shared_tokens

    def share(self, tokens: torch.Tensor) -> None:
        """The tokens the last plan promised, to every rank (an all-reduce to
        which the followers add zeros; on the device, no host sync)."""
        with self.lock:
            all_reduce(tokens.clone())
            self.owed = 0

    def _beat(self) -> None:
        while not self._stop.wait(self.interval / 4):
            with self.lock:
                if self._stop.is_set() or self.owed or time.monotonic() - self.last < self.interval:
                    continue
                try:
                    # A round trip, not just a send: a follower that hangs
                    # (stopped, stuck) fails it within the timeout too.
                    self.send(HEARTBEAT)
                    ping()
                except Exception as e:       # a follower is gone: the next step raises it
                    self.error = e
                    log.error("tensor parallel: heartbeat to the other ranks failed: %s", str(e).splitlines()[0])
                    return

    def check(self) -> None:
        """Raise what the heartbeat found (a follower gone while idle)."""
        if self.error is not None:
            raise RuntimeError(f"tensor parallel: a follower rank is gone ({str(self.error).splitlines()[0]})")

    def close(self) -> None:
        """Tell the followers to exit (best effort: they may be gone)."""
        self._stop.set()
        with self.lock:
            if self.error is None:
                try:
                    if self.owed:     # a step ended without its tokens (an error): the followers wait for them
                        all_reduce(torch.zeros(self.owed, dtype=torch.int64, device=self.device))
                    self.send(STOP)
                except Exception:
                    pass
        self._thread.join(timeout=5)


def run_follower(args: EngineArgs, rank: int) -> None:
    """A follower rank's life: the Worker's startup phases, then the leader's plans."""
    from engine.model_runner import ModelRunner, StepPlan
    from engine.mtp_proposer import HeadPlan, run_head
    from engine.worker import Worker
    worker = Worker(args, rank=rank)
    runner = ModelRunner(worker.model, None, worker.caches, graphs=worker.graphs, head_graphs=worker.head_graphs,
                         groups=worker.plan.groups, block_size=worker.plan.block_size, lora=worker.lora)
    runner.keep_streams = worker.mtp_drafts     # the leader's MTP proposer runs the head after each step
    distributed.startup_done()
    log.info("rank %d ready: %d KV blocks per group, waiting for the leader's steps", rank,
             worker.plan.num_blocks[0])
    steps = 0
    while True:
        msg = broadcast_object()
        if msg == HEARTBEAT:
            ping()
            continue
        if msg == STOP:
            break
        if isinstance(msg, HeadPlan):
            run_head(runner, msg)
            continue
        if isinstance(msg, Sleep):
            worker.sleep(msg.level, runner)
            continue
        if isinstance(msg, WakeUp):
            worker.wake_up(msg.tags, runner)
            continue
        assert isinstance(msg, StepPlan), type(msg)
        runner.follow(msg)
        steps += 1
    log.info("rank %d: the leader stopped after %d steps", rank, steps)
    distributed.shutdown_distributed()


def _rank_main(args: EngineArgs, rank: int) -> None:
    """Entry of a spawned rank: dies with its parent; one error line, exit 1."""
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_follower(args, rank)
    except Exception as e:
        log.error("rank %d failed: %s: %s", rank, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        sys.exit(1)


def start_local_ranks(args: EngineArgs, ranks) -> list:
    """Start these ranks on this node, each in its own process."""
    ctx = mp.get_context("spawn")
    procs = []
    for r in ranks:
        p = ctx.Process(target=_rank_main, args=(args, r), name=f"tqserve-rank-{r}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def run_headless(args: EngineArgs) -> int:
    """`tqserve serve --headless`: this node's ranks, without HTTP or scheduler.
    The node's first rank runs here, the others in child processes. Returns
    the exit code: 0 when the leader stopped the group, 1 on an error."""
    topo = args.topology()
    ranks = topo.node_ranks
    log.info("headless node %d: ranks %d..%d of %d, leader at %s:%d", topo.node_rank, ranks.start,
             ranks.stop - 1, topo.tp_size, topo.master_addr, topo.master_port)
    procs = start_local_ranks(args, ranks[1:])
    rc = 0
    try:
        run_follower(args, ranks.start)
    except Exception as e:
        log.error("rank %d failed: %s: %s", ranks.start, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        rc = 1
    for p in procs:
        p.join(timeout=10 if rc == 0 else 1)
        if p.is_alive():
            p.kill()
        rc = rc or (p.exitcode != 0)
    return int(rc)
