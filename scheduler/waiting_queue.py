"""The queue of requests waiting for admission, one class per scheduling policy.

Both put a preempted request back at the head of its priority class, so it resumes
before anything that arrived after it. Whatever the policy, background requests
(batch jobs' lines) wait in a queue of their own behind every interactive one
(ForegroundFirst): a batch of 50,000 lines never stands between a user and the
engine, and its lines still keep their policy's order among themselves."""
from __future__ import annotations

import heapq
import itertools
from collections import deque

from kvserve.scheduler.request import Request


class FCFSQueue:
    """First come, first served."""

    def __init__(self):
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def push_front_all(self, reqs: list[Request]) -> None:
        """Back at the head, in their order."""
        self._q.extendleft(reversed(reqs))

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue:
    """Lower `priority` first; within a priority, arrival order. A heap of
    (priority, rank, request): new requests get increasing ranks, preempted ones
    decreasing negative ranks, so the latest preempted leads its class."""

    def __init__(self):
        self._heap: list[tuple[int, int, Request]] = []
        self._next_rank = itertools.count()
        self._front_rank = itertools.count(-1, -1)

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, next(self._next_rank), req))

    def push_front(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, next(self._front_rank), req))

    def push_front_all(self, reqs: list[Request]) -> None:
        """Each at the head of its priority class, in their order."""
        for req in reversed(reqs):
            self.push_front(req)

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[2] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[2] for e in sorted(self._heap, key=lambda e: e[:2]))


class ForegroundFirst:
    """Two queues of one policy: interactive requests, then background ones. The
    scheduler sees one queue."""

    def __init__(self, make):
        self.foreground, self.background = make(), make()

    def _of(self, req: Request):
        return self.background if req.background else self.foreground

    def push(self, req: Request) -> None:
        self._of(req).push(req)

    def push_front(self, req: Request) -> None:
        self._of(req).push_front(req)

    def push_front_all(self, reqs: list[Request]) -> None:
        for req in reversed(reqs):
            self._of(req).push_front(req)

    def _first(self):
        return self.foreground if self.foreground else self.background

    def peek(self) -> Request:
        return self._first().peek()

    def pop(self) -> Request:
        return self._first().pop()

    def remove(self, req: Request) -> None:
        self._of(req).remove(req)

    def __len__(self) -> int:
        return len(self.foreground) + len(self.background)

    def __iter__(self):
        yield from self.foreground
        yield from self.background


def make_waiting_queue(policy: str) -> ForegroundFirst:
    if policy == "fcfs":
        return ForegroundFirst(FCFSQueue)
    if policy == "priority":
        return ForegroundFirst(PriorityQueue)
    raise ValueError(f"unknown scheduling policy {policy!r}; choose fcfs or priority")
