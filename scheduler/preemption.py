"""Preemption, a part of the Scheduler (scheduler.py): when the KV cache cannot hold
a running request's next tokens, blocks are freed until they fit, first those of
requests about to finish, then those of victims the policy picks (background
requests, batch jobs' lines, before any interactive one; then the lowest priority,
latest arrived), which go back to the head of the waiting queue keeping their
tokens. Uses the Scheduler's running list, waiting queue, config and cache."""
from __future__ import annotations

from kvserve.scheduler.output import SchedulerOutput
from kvserve.scheduler.request import Request, RequestStatus


class Preemption:
    def _make_room(self, req: Request, n: int, out: SchedulerOutput, i: int,
                   budget: int) -> tuple[int, int]:
        """req's n tokens (req at running[i]) did not fit: frees blocks until they do,
        or req itself is preempted: first the blocks of requests about to finish,
        then victims the policy picks. Returns i and the budget, corrected for
        victims served earlier in this step, whose tokens are taken back."""
        while True:
            finishing = self._finishing(out)
            if not self._free_blocks_of(finishing):
                victim = self._pick_victim(finishing)
                if self.running.index(victim) < i:  # served before req (or skipped)
                    budget += self._unschedule(victim, out)
                    i -= 1
                self._preempt(victim, out)
                if victim is req:
                    return i, budget
            if self.kv.allocate_slots(req.request_id, req.token_ids,
                                      req.num_computed_tokens, n, 0, req.num_pending_tokens):
                return i, budget

    def _finishing(self, out: SchedulerOutput) -> list[Request]:
        """Async scheduling: running requests left out of this step because the token
        on its way ends them (the pending tokens of those in it are this step's)."""
        this_step = {id(s.request) for s in out.scheduled}
        return [r for r in self.running if r.num_pending_tokens and id(r) not in this_step
                and self._ends_with_pending(r)]

    def _free_blocks_of(self, finishing: list[Request]) -> bool:
        """When blocks run out, finishing requests give theirs up first: they compute
        nothing more (the step still writing them runs before any later step reads
        them). True if any blocks were freed."""
        freed = False
        for r in finishing:
            if self.kv.live_block_table(r.request_id):
                self.kv.free(r.request_id, r.num_computed_tokens)
                freed = True
        return freed

    def _pick_victim(self, finishing: list[Request]) -> Request:
        running = self.running
        if finishing:  # they hold no blocks any more
            running = [r for r in running if r not in finishing]
        background = [r for r in running if r.background]
        if background:  # a batch job's line goes before any interactive request
            running = background
        if self.config.policy == "priority":
            # Ties (siblings of one prompt share its arrival) go to the latest
            # admitted, as in fcfs: taking the front one, which has computed the
            # most, again and again could cycle the group forever.
            return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))
        return running[-1]

    @staticmethod
    def _unschedule(req: Request, out: SchedulerOutput) -> int:
        """Takes req's share of this step back; returns its tokens (0: it had none,
        its last token still on the way)."""
        item = next((s for s in out.scheduled if s.request is req), None)
        if item is None:
            return 0
        out.scheduled.remove(item)
        req.num_computed_tokens = item.start
        if item.samples:
            req.num_pending_tokens -= 1
        return item.num_new_tokens + len(item.spec_token_ids)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        # Blocks past its computed tokens (its step in this schedule was taken back)
        # are hashed but never computed. A token still pending comes in by update().
        self.kv.free(req.request_id, req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.push_front(req)
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
