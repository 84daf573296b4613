"""What a step brings back to the scheduler: each request's sampled token appended
(a verification's accepted drafts and the token after them), the siblings of an n > 1
request forked off their parent once its prompt is computed, and the requests a token
finished taken out of the queues."""
from __future__ import annotations

import time

from kvserve.scheduler.output import SchedulerOutput
from kvserve.scheduler.request import Request, RequestStatus


class StepResults:
    """Mixed into Scheduler, whose queues, requests, KV cache manager and _release
    it uses."""

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record the step's sampled tokens (its computed tokens were counted when it
        was scheduled); returns the requests that got a new token, finished ones
        included (already out of the batch and freed). Under async scheduling the
        next step is scheduled already: a request may have been preempted since."""
        changed = []
        now = time.monotonic()  # one clock read stamps every token of the step
        finished = RequestStatus.FINISHED
        for item in out.scheduled:
            req = item.request
            if item.samples:
                req.num_pending_tokens -= 1
            if req.status is finished:  # aborted, or ended by a token, since
                continue
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
        waiting = req.status is RequestStatus.WAITING  # preempted while the step ran
        req.append_token(token, self.config.max_model_len, now)
        changed.append(req)
        if req.status is RequestStatus.FINISHED:
            (self.waiting if waiting else self.running).remove(req)
            self._release(req)
