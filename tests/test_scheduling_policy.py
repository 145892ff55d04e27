"""--scheduling-policy (engine/request_queue.py, vLLM's flag and request
field): fcfs admits in arrival order and preempts the newest running
request; priority admits by `priority` (lower first), then arrival, and
preempts the lowest-priority, newest one. A priority under fcfs is refused,
as vLLM does (HTTP: tests/test_server_openai.py)."""
import pytest
from tiny_models import save_tiny_llama, token_prompts

from engine import LLM, SamplingParams
from engine.errors import InvalidRequest
from engine.request import Request
from engine.request_queue import FcfsQueue, PriorityQueue


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_policy")
    save_tiny_llama(path)
    return str(path)


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


class _R:
    def __init__(self, name, priority, arrival):
        self.name, self.priority, self.arrival_time = name, priority, arrival


def test_queues():
    reqs = [_R("a", 2, 0.0), _R("b", 0, 1.0), _R("c", 2, 2.0), _R("d", -1, 3.0)]
    f, p = FcfsQueue(), PriorityQueue()
    for r in reqs:
        f.add(r)
        p.add(r)
    assert [r.name for r in f] == ["a", "b", "c", "d"] and [r.name for r in p] == ["d", "b", "a", "c"]
    assert f.pop().name == "a" and p.pop().name == "d"
    p.readd(reqs[3])                        # preempted: back in its place, not behind later arrivals
    f.readd(reqs[0])
    assert p.peek().name == "d" and f.peek().name == "a"
    p.remove(reqs[0])
    assert reqs[0] not in p and reqs[2] in p and len(p) == 3
    running = []
    for r in reqs:
        p.admit(running, r)
    assert [r.name for r in running] == ["d", "b", "a", "c"]      # the last is preempted first


def run(llm, prompts, priorities, n):
    """Add every request, then step to the end: (the order they finished,
    their Request objects, their tokens)."""
    rids = [llm.add_request(p, greedy(n), priority=pr) for p, pr in zip(prompts, priorities)]
    reqs = [llm.core.scheduler.requests[r] for r in rids]
    done, toks = [], {}
    while llm.core.has_work():
        for o in llm.step():
            if o.finished:
                done.append(rids.index(o.request_id))
                toks[o.request_id] = o.outputs[0].token_ids
    return done, reqs, [toks[r] for r in rids]


def test_priority_admits_lowest_first(tiny):
    """One running request at a time: requests finish in priority order
    (arrival breaking ties) instead of arrival order, with the same tokens."""
    ps = token_prompts(5, 5, 20, seed=3)
    pr = [2, 0, 1, 0, -1]
    fcfs = LLM(tiny, block_size=4, max_num_seqs=1)
    with pytest.raises(InvalidRequest, match="needs --scheduling-policy priority"):
        fcfs.add_request(ps[0], greedy(4), priority=1)
    with pytest.raises(InvalidRequest, match="1 priorities"):
        fcfs.generate(ps, greedy(4), priority=[0])
    order_f, _, toks_f = run(fcfs, ps, [0] * 5, 6)
    assert order_f == [0, 1, 2, 3, 4]
    llm = LLM(tiny, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    order, _, toks = run(llm, ps, pr, 6)
    assert order == [4, 1, 3, 2, 0] and toks == toks_f
    out = llm.generate(ps[:2], greedy(6), priority=[1, 0])           # LLM.generate takes them too
    assert [o.outputs[0].token_ids for o in out] == toks_f[:2]


@pytest.mark.parametrize("policy,victim", [("fcfs", 2), ("priority", 1)])
def test_preemption_takes_the_last_in_policy_order(tiny, policy, victim):
    """Three requests that do not fit the pool together (priorities 0, 5, 1
    in arrival order): fcfs preempts the newest, priority the one of
    priority 5; tokens equal a pool with room for all."""
    ps = token_prompts(3, 20, 21, seed=5)
    pr = [0, 5, 1] if policy == "priority" else [0, 0, 0]
    _, _, ref = run(LLM(tiny, block_size=4), ps, [0, 0, 0], 40)
    # 512 B/token (tests/test_engine_tiny.py): room for 120 of the 180 tokens
    small = LLM(tiny, block_size=4, kv_cache_memory=120 * 512, max_model_len=64, scheduling_policy=policy)
    _, reqs, toks = run(small, ps, pr, 40)
    assert toks == ref
    pre = [r.num_preemptions for r in reqs]
    assert pre[victim] > 0 and sum(pre) == pre[victim], pre
    assert small.core.kv.num_used_blocks == 0


def test_bad_policy_is_one_error(tiny):
    with pytest.raises(ValueError, match="unknown scheduling_policy 'lifo'"):
        LLM(tiny, scheduling_policy="lifo")
    with pytest.raises(InvalidRequest, match="priority must be an integer"):
        LLM(tiny, scheduling_policy="priority").add_request([1, 2, 3], greedy(2), priority=1.5)


def test_request_carries_priority():
    from engine.request import EngineRequest
    r = Request(EngineRequest("x", [1, 2], greedy(1), priority=-3), max_model_len=16)
    assert r.priority == -3
