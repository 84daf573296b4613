"""Continuous batching under one token budget per step.

There are no prefill or decode phases: each request has tokens it knows and tokens
whose KV is computed, and each step lets requests catch up under one token budget.
Running requests are served first (a decode is one token, the rest of a chunked prompt
up to the budget), then waiting requests are admitted while the budget, the sequence
cap and the KV cache allow. A long prompt is cut into chunks that share steps with
everyone else's decodes. When the cache cannot hold a running request's next tokens,
the lowest-priority, latest-arrived running request is preempted: its blocks are freed
and it is recomputed later (prefix hits make that cheap), keeping the tokens it has
already generated. Nobody is preempted just to admit a newcomer."""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvcache import KVCacheManager
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.waiting_queue import make_waiting_queue


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    policy: str = "fcfs"  # fcfs | priority
    # Most tokens one request may compute in a step (0: no cap beyond the budget).
    long_prefill_token_threshold: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("token budget and max_num_seqs must be positive")
        self.config = config
        self.kv = kv
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- requests in and out ------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort(self, request_id: str, reason: str = "abort") -> list[Request]:
        """Ends the request (and any siblings still waiting to fork from it).
        reason: the finish reason to record; "stop" when the front end ended it at a
        stop string, so metrics count it as the stop it is."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        req.finish(reason)
        self._release(req)
        siblings, req.pending_forks = req.pending_forks, []
        for child in siblings:
            child.finish("abort")
        return [req, *siblings]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # never preempt someone just to admit a newcomer
            self._admit_waiting(out, budget)
        out.block_copies = self.kv.take_copies()
        return out

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = min(len(req.token_ids) - req.num_computed_tokens, budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # The hot loop of the engine (every running request, every step): bound
        # methods are hoisted, and a decode skips the general token count.
        running, allocate, table = self.running, self.kv.allocate_slots, self.kv.live_block_table
        scheduled = out.scheduled
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = len(req.token_ids) - req.num_computed_tokens
            if n != 1:
                n = self._num_new_tokens(req, budget)
            elif req.spec_token_ids:
                # Drafts never take the token another running request needs.
                item = self._schedule_drafts(req, budget - (len(running) - i - 1))
                if item is not None:
                    scheduled.append(item)
                    budget -= 1 + len(item.spec_token_ids)
                    i += 1
                    continue
            while not allocate(req.request_id, req.token_ids, req.num_computed_tokens, n):
                victim = self._pick_victim()
                pos = self.running.index(victim)
                self._preempt(victim, out)
                if victim is req:
                    break
                if pos < i:  # already scheduled this step: take its tokens back
                    budget += self._unschedule(victim, out)
                    i -= 1
            if req.status is RequestStatus.WAITING:
                # It ranked lowest and went itself: everyone left in running ranks
                # above it (priority) or there is no one left (fcfs); serve them.
                continue
            scheduled.append(ScheduledRequest(req, n, table(req.request_id)))
            budget -= n
            i += 1
        return budget

    def _schedule_drafts(self, req: Request, budget: int) -> ScheduledRequest | None:
        """A decode plus its drafts, as many as `budget` (what the running requests
        after it leave), the model length and the free blocks allow; None (drafts
        dropped) leaves a plain decode to the caller, which preempts if even that
        cannot fit: drafts never cost anyone their seat or their token."""
        spec, req.spec_token_ids = req.spec_token_ids, []
        room = min(budget - 1, self.config.max_model_len - len(req.token_ids))
        spec = spec[:max(0, room)]
        if not spec or not self.kv.allocate_slots(req.request_id, req.token_ids,
                                                  req.num_computed_tokens, 1, len(spec)):
            return None
        return ScheduledRequest(req, 1, self.kv.live_block_table(req.request_id), spec)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            # Ties (siblings of one prompt share its arrival) go to the latest
            # admitted, as in fcfs: taking the front one, which has computed the
            # most, again and again could cycle the group forever.
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    @staticmethod
    def _unschedule(req: Request, out: SchedulerOutput) -> int:
        item = next(s for s in out.scheduled if s.request is req)
        out.scheduled.remove(item)
        return item.num_new_tokens + len(item.spec_token_ids)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Siblings still to fork from a running parent take their seats when it forks
        # (not counted when the batch is full anyway: the common case stays cheap).
        num_seqs = len(self.running)
        if self.waiting and num_seqs < self.config.max_num_seqs:
            num_seqs += sum(len(r.pending_forks) for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting.peek()
            if num_seqs + 1 + len(req.pending_forks) > self.config.max_num_seqs \
                    and self.running:
                return
            if req.num_computed_tokens == 0:
                cached = self.kv.lookup_prefix(req.request_id, req.token_ids, req.cache_salt,
                                               match=not req.needs_prompt_logits)
                req.num_computed_tokens = cached
                if req.num_preemptions == 0:
                    req.num_cached_tokens = cached
            n = self._num_new_tokens(req, budget)
            if not self.kv.allocate_slots(req.request_id, req.token_ids,
                                          req.num_computed_tokens, n):
                self.kv.free(req.request_id)  # let go of the prefix it looked up
                req.num_computed_tokens = 0
                return
            self.waiting.pop()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_seqs += 1 + len(req.pending_forks)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.live_block_table(req.request_id)))
            budget -= n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        # Scheduled earlier in this step, its new blocks are hashed but never computed.
        self.kv.free(req.request_id, req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.push_front(req)
        self.num_preemptions += 1
        out.preempted.append(req.request_id)

    # -- results of the step ---------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record computed tokens and sampled tokens; returns the requests that got a
        new token, finished ones included (already out of the batch and freed)."""
        changed = []
        now = time.monotonic()  # one clock read stamps every token of the step
        finished = RequestStatus.FINISHED
        for item in out.scheduled:
            req = item.request
            if req.status is finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += item.num_new_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue
            if item.spec_token_ids:
                self._append_verified(req, token, changed, now)
                continue
            # Siblings fork before the parent's token can finish it and free its blocks.
            if req.pending_forks:
                for child in self._fork_siblings(req):
                    self._append(child, sampled[child.request_id], changed, now)
            self._append(req, token, changed, now)
        return changed

    def _append_verified(self, req: Request, tokens: list[int], changed: list[Request],
                         now: float) -> None:
        """A verification step's tokens: the accepted drafts, then the one sampled
        after them. Their KV (the drafts') is computed; the rejected drafts' slots
        are given back. `tokens` is cut to those appended when one finishes the
        request, so the caller sees exactly what was added."""
        req.num_computed_tokens += len(tokens) - 1
        for j, token in enumerate(tokens):
            req.append_token(token, self.config.max_model_len, now)
            if req.status is RequestStatus.FINISHED:
                del tokens[j + 1:]
                break
        changed.append(req)
        if req.status is RequestStatus.FINISHED:
            self.running.remove(req)
            self._release(req)
        else:
            self.kv.settle_verified(req.request_id, req.token_ids, req.num_computed_tokens)

    def _fork_siblings(self, parent: Request) -> list[Request]:
        """The prompt's KV is computed: siblings share all of it, the partly filled
        last block included (copy-on-write separates them at the next write)."""
        children, parent.pending_forks = parent.pending_forks, []
        for child in children:
            self.kv.fork(parent.request_id, child.request_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            child.status = RequestStatus.RUNNING
            self.requests[child.request_id] = child
            self.running.append(child)
        return children

    def _append(self, req: Request, token: int, changed: list[Request], now: float) -> None:
        req.append_token(token, self.config.max_model_len, now)
        changed.append(req)
        if req.status is RequestStatus.FINISHED:
            self.running.remove(req)
            self._release(req)

    def _release(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
