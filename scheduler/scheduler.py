"""Continuous batching under one token budget per step.

There are no prefill or decode phases: each request has tokens it knows and tokens
whose KV is computed, and each step lets requests catch up under one token budget.
Running requests are served first (a decode is one token, the rest of a chunked prompt
up to the budget), then waiting requests are admitted while the budget, the sequence
cap and the KV cache allow. A long prompt is cut into chunks that share steps with
everyone else's decodes. When the cache cannot hold a running request's next tokens,
the lowest-priority, latest-arrived running request is preempted (background ones,
batch jobs' lines, first): its blocks are freed and it is recomputed later (prefix
hits make that cheap), keeping the tokens it has already generated. Nobody is
preempted just to admit a newcomer. Background requests wait behind interactive
ones, and their prompts leave interactive requests most of a step (schedule()).

A request's computed tokens count a step's tokens from the moment it is scheduled,
and the token the step will sample is pending until update() brings it. That lets
async scheduling plan step N+1 while step N still runs: a request's pending token is
simply the next one it computes (the runner feeds it on the device)."""
from __future__ import annotations

import time

from kvserve.kvcache import HybridKVCacheManager, KVCacheManager
from kvserve.kvcache.second_tier import SecondTier
from kvserve.kvcache.events import KVCacheEvent
from kvserve.scheduler.config import KVCacheConfig, SchedulerConfig
from kvserve.scheduler.failed_steps import withdraw_unwritten
from kvserve.scheduler.output import ScheduledRequest, SchedulerOutput
from kvserve.scheduler.preemption import Preemption
from kvserve.scheduler.request import Request, RequestStatus
from kvserve.scheduler.snapshot import SchedulerSnapshot
from kvserve.scheduler.stats import SchedulerStats
from kvserve.scheduler.step_results import StepResults
from kvserve.scheduler.waiting_queue import make_waiting_queue


INTERACTIVE_LINGER_S = 2.0


class Scheduler(Preemption, StepResults):
    """Owns the waiting and running queues and the KV cache manager; the engine
    drives it by schedule / update / abort / fail_requests, reads stats() every
    step and snapshot() when someone watches the engine page."""

    @classmethod
    def with_kv_cache(cls, config: SchedulerConfig, cache: KVCacheConfig,
                      tier: SecondTier | None = None) -> Scheduler:
        return cls(config, cache.manager(tier))

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | HybridKVCacheManager):
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("token budget and max_num_seqs must be positive")
        self.config = config
        self.kv = kv
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # A client's request -> its n sequences (the siblings still to fork too),
        # until all have finished: what abort_request finds them by.
        self.groups: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        # What background prompts may still compute in the step being planned, and
        # until when their share stays small (interactive requests were seen).
        self._background_left = config.max_num_batched_tokens
        self._interactive_until = float("-inf")
        self._seats = 1 << 30  # most requests the step being planned may take

    # -- requests in and out ------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.group_id in self.groups:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.groups[request.group_id] = [request, *request.pending_forks]
        self.waiting.push(request)

    def abort_request(self, request_id: str, index: int | None = None,
                      reason: str = "abort") -> list[Request]:
        """Ends a client's request: all its sequences, or the one at `index` (a stop
        string ended it). Returns the sequences it ended."""
        group = self.groups.get(request_id, [])
        ended = []
        for seq in group if index is None else group[index:index + 1]:
            if not seq.finished and seq.request_id in self.requests:
                ended += self.abort(seq.request_id, reason)
        return ended

    def abort(self, request_id: str, reason: str = "abort") -> list[Request]:
        """Ends the request (and any siblings still waiting to fork from it) with
        `reason`: "stop" when the front end found a stop string (metrics count it so)."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        req.finish(reason)
        siblings, req.pending_forks = req.pending_forks, []
        for child in siblings:
            child.finish("abort")
        self._release(req)  # once its whole group has finished
        return [req, *siblings]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats.of(self)

    def snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot.of(self)

    def pin_prompt(self, token_ids: list[int], cache_salt: str | None,
                   lora: str | None) -> list[tuple[int, bytes]]:
        """Pins a finished prompt's cached blocks (kvcache/prefix_pins.py), for
        another instance to read; unpin() lets go."""
        return self.kv.pin_prefix(token_ids, cache_salt, lora)

    def prompt_hashes(self, token_ids: list[int], cache_salt: str | None,
                      lora: str | None) -> list[bytes]:
        return self.kv.prompt_hashes(token_ids, cache_salt, lora)

    def cached_prefix(self, hashes: list[bytes]) -> int:
        return self.kv.cached_prefix(hashes)

    def unpin(self, block_ids: list[int]) -> None:
        self.kv.unpin(block_ids)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """What entered and left the prefix cache since the last call (or [])."""
        return self.kv.take_events()

    # -- a step that failed on the device side ----------------------------------
    def withdraw_unwritten(self, out: SchedulerOutput, failed: dict[str, str]) -> None:
        """Takes the blocks that failed requests of `out` never wrote out of the
        prefix cache, failing in turn those of `out` that hit them (failed_steps.py)."""
        withdraw_unwritten(self.kv, out, failed)

    def fail_requests(self, out: SchedulerOutput, failed: dict[str, str]
                      ) -> list[tuple[Request, str]]:
        """Ends the requests of `out` the step failed for (request id -> why), and
        their siblings still to fork, with reason "error"; returns (request, why) for
        each. The step's new blocks hold KV never confirmed good: they leave the
        prefix cache, as a preempted request's do, before the rest is freed."""
        starts = {s.request.request_id: s.start for s in out.scheduled}
        ended = []
        for rid, why in failed.items():
            if rid in self.requests:
                self.kv.free(rid, starts[rid])
                ended += [(r, why) for r in self.abort(rid, "error")]
        return ended

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Background prompts (batch jobs) leave the step's budget to interactive
        # requests first: all of it while interactive ones wait, a token for each
        # running one behind them, and at most background_prefill_tokens while any
        # runs or ran in the last INTERACTIVE_LINGER_S (a client's next request comes
        # soon, and finds a step in flight), so a batch's long prefills delay neither a
        # user's first token nor the next: a step with a whole budget of prompt takes
        # half a second on 2 cores. If that leaves the step empty (the newcomers did
        # not fit), the background prompts take it after all.
        running = self.running
        background = sum(1 for r in running if r.background) if running else 0
        hold = background > 0 and bool(self.waiting.foreground)
        cap, now = self.config.background_prefill_tokens, time.monotonic()
        if self.waiting.foreground or len(running) > background:
            self._interactive_until = now + INTERACTIVE_LINGER_S
        self._background_left = cap if cap > 0 and now < self._interactive_until else budget
        depth = self.config.steps_in_flight
        self._seats = -(-(len(running) + len(self.waiting)) // depth) if depth > 1 else 1 << 30
        budget = self._schedule_running(out, budget, background, hold)
        if not out.preempted:  # never preempt someone just to admit a newcomer
            self._admit_waiting(out, budget)
        if hold and not out.scheduled:
            self._schedule_running(out, budget, background, False)
        out.block_copies = self.kv.take_copies()
        return out

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = min(len(req.token_ids) + req.num_pending_tokens - req.num_computed_tokens, budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n

    def _background_chunk(self, req: Request, budget: int, foreground_after: int,
                          hold: bool) -> int:
        """A running background prompt's tokens this step: none while interactive
        requests wait (hold), else within the step's background share, leaving a
        token for each interactive request after it."""
        if hold:
            return 0
        n = self._num_new_tokens(req, min(self._background_left, budget - foreground_after))
        self._background_left -= max(n, 0)
        return n

    def _schedule_running(self, out: SchedulerOutput, budget: int, background: int = 0,
                          hold_background: bool = False) -> int:
        # The hot loop of the engine (every running request, every step): bound
        # methods are hoisted, and a decode skips the general token count. background:
        # how many running requests are; hold_background: their prompts wait a step.
        running, allocate, table = self.running, self.kv.allocate_slots, self.kv.live_block_table
        groups = self.kv.live_group_tables
        scheduled = out.scheduled
        foreground_after = len(running) - background  # interactive ones from i on
        i = 0
        wait_for_sampled = self.config.steps_in_flight > 1
        while i < len(running) and budget > 0 and len(scheduled) < self._seats:
            req = running[i]
            foreground_after -= not req.background
            pending = req.num_pending_tokens
            if pending and (wait_for_sampled or self._ends_with_pending(req)):
                i += 1  # its (last) token is still on the way: nothing to compute yet
                continue
            n = len(req.token_ids) + pending - req.num_computed_tokens
            if n != 1:
                n = (self._background_chunk(req, budget, foreground_after, hold_background)
                     if req.background else self._num_new_tokens(req, budget))
                if n <= 0 and req.background:
                    i += 1
                    continue
            elif req.spec_token_ids:
                # Drafts never take the token another running request needs.
                item = self._schedule_drafts(req, budget - (len(running) - i - 1))
                if item is not None:
                    scheduled.append(item)
                    budget -= 1 + len(item.spec_token_ids)
                    i += 1
                    continue
            if not allocate(req.request_id, req.token_ids, req.num_computed_tokens, n,
                            0, pending):
                i, budget = self._make_room(req, n, out, i, budget)
                if req.status is RequestStatus.WAITING:
                    # It ranked lowest and went itself: everyone left in running ranks
                    # above it (priority) or there is no one left (fcfs); serve them.
                    continue
            item = ScheduledRequest(req, n, table(req.request_id),
                                    group_tables=groups(req.request_id))
            scheduled.append(item)
            req.num_computed_tokens += n
            if item.samples:
                req.num_pending_tokens = pending + 1
            budget -= n
            i += 1
        return budget

    def _ends_with_pending(self, req: Request) -> bool:
        """Will the tokens still on their way finish `req` by length (max_tokens or
        the model's length)? Then scheduling it again would compute a token past its
        end. (A stop token cannot be foreseen: that step's row is wasted.)"""
        pending = req.num_pending_tokens
        return (req.num_output_tokens + pending >= req.params.max_tokens
                or len(req.token_ids) + pending >= self.config.max_model_len)

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
        item = ScheduledRequest(req, 1, self.kv.live_block_table(req.request_id), spec,
                                self.kv.live_group_tables(req.request_id))
        req.num_computed_tokens += 1  # the accepted drafts are added by update()
        req.num_pending_tokens += 1
        return item

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []  # no slot for their LoRA adapter: they step aside
        self._admit(out, budget, skipped)
        self.waiting.push_front_all(skipped)

    def _admit(self, out: SchedulerOutput, budget: int, skipped: list[Request]) -> None:
        # Siblings still to fork from a running parent take their seats when it forks
        # (not counted when the batch is full anyway: the common case stays cheap).
        num_seqs = len(self.running)
        if self.waiting and num_seqs < self.config.max_num_seqs:
            num_seqs += sum(len(r.pending_forks) for r in self.running)
        # LoRA adapters running, and None: the base model is never held back.
        adapters = {None, *(r.lora for r in self.running)} if self.config.max_loras else set()
        while self.waiting and budget > 0 and len(out.scheduled) < self._seats:
            req = self.waiting.peek()
            if num_seqs + 1 + len(req.pending_forks) > self.config.max_num_seqs \
                    and self.running:
                return
            if req.num_pending_tokens:  # preempted with its token still on the way
                return
            if req.background and self._background_left <= 0:
                return  # the rest wait too: background ones come last
            if req.lora not in adapters and len(adapters) > self.config.max_loras > 0:
                skipped.append(self.waiting.pop())
                continue
            if req.num_computed_tokens == 0:
                cached = self.kv.lookup_prefix(req.request_id, req.token_ids, req.cache_salt,
                                               match=not req.computes_whole_prompt,
                                               adapter=req.lora)
                req.num_computed_tokens = cached
                if req.num_preemptions == 0:
                    req.num_cached_tokens = cached
            n = self._num_new_tokens(req, min(budget, self._background_left)
                                     if req.background else budget)
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
            adapters.add(req.lora)
            num_seqs += 1 + len(req.pending_forks)
            item = ScheduledRequest(req, n, self.kv.live_block_table(req.request_id),
                                    group_tables=self.kv.live_group_tables(req.request_id))
            out.scheduled.append(item)
            req.num_computed_tokens += n
            req.num_pending_tokens += item.samples
            budget -= n
            self._background_left -= n if req.background else 0

    def _release(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        group = self.groups.get(req.group_id)
        if group is not None and all(seq.finished for seq in group):
            del self.groups[req.group_id]
