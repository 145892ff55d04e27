"""The scheduler's waiting queue, one class per scheduling policy (vLLM's
`--scheduling-policy`): which waiting request is admitted next, and where an
admitted request goes in the running list, whose last request is the first
preempted when KV blocks run out (engine/scheduler.py).

  fcfs      arrival order; a preempted request goes back to the front; the
            newest running request is preempted first.
  priority  the request's `priority` (lower first, vLLM's meaning), then
            arrival; the running list is kept in that order, so running
            requests get the step's token budget in that order and the
            lowest-priority, newest one is preempted first. A waiting request
            never preempts a running one (as vLLM v1)."""
import bisect
import heapq
from collections import deque
from collections.abc import Iterator

from engine.request import Request


class FcfsQueue:
    def __init__(self):
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def readd(self, req: Request) -> None:
        """A preempted request: next in line."""
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    @staticmethod
    def admit(running: list[Request], req: Request) -> None:
        running.append(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def __contains__(self, req: Request) -> bool:
        return req in self._q


def _key(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


class PriorityQueue:
    def __init__(self):
        self._heap: list[tuple[int, float, int, Request]] = []
        self._n = 0             # ties (same priority and arrival: a request's n choices) in insertion order

    def add(self, req: Request) -> None:
        self._n += 1
        heapq.heappush(self._heap, (*_key(req), self._n, req))

    readd = add              # a preempted request keeps its place by priority and arrival

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[-1] is not req]
        heapq.heapify(self._heap)

    @staticmethod
    def admit(running: list[Request], req: Request) -> None:
        bisect.insort_right(running, req, key=_key)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap))

    def __contains__(self, req: Request) -> bool:
        return any(e[-1] is req for e in self._heap)


QUEUES = {"fcfs": FcfsQueue, "priority": PriorityQueue}     # engine_args.SCHEDULING_POLICIES


def make_queue(policy: str) -> FcfsQueue | PriorityQueue:
    return QUEUES[policy]()
