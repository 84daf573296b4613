"""A deterministic simulation of the scheduler and the KV cache, with no model.

The fake runner gives every request that samples the token ``fake_token(request_id,
position)``: it depends only on who asks and where, never on the batch, the step or
the KV contents, so a request must end with exactly ``expected_tokens(...)`` however
often it was chunked, preempted and recomputed.

A fake device stores, for every physical block, the token ids written into its slots
(a freshly allocated block is filled with junk), applies the copy-on-write
instructions and checks that what a request attends to (the slots its block table
points at) holds exactly its own tokens. That catches a block written by someone
else, a missing copy-on-write, and a prefix hit on a block whose KV was never
computed.

``Simulation.run()`` drives the loop the engine runs (schedule -> execute -> update)
and checks the scheduler's invariants after every ``schedule()`` and every
``update()``; it raises ``AssertionError`` on the first violation and returns a
``SimResult`` with what happened, for the tests' end-of-run checks. With
``overlap=True`` it runs the loop of async scheduling instead: step N+1 is scheduled
and executed before step N's tokens reach ``update()`` (the fake device knows them:
the next step's pending tokens), except after a step with a forking parent, which
completes first, as in the engine.
"""
from __future__ import annotations

import math
import random
import zlib
from collections import Counter
from dataclasses import dataclass, field

from kvserve.kvcache import KVCacheManager
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.output import SchedulerOutput
from kvserve.scheduler.request import Request, RequestStatus
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from tests.kvcache.kvcache_sim import check_pool_invariants

ABORT_KINDS = ("waiting", "preempted", "prefill", "decode", "mid_step", "forking_parent",
               "child")


# -- the fake model ---------------------------------------------------------------

def _rid_hash(request_id: str) -> int:
    return zlib.crc32(request_id.encode())


def fake_token(request_id: str, position: int) -> int:
    """The token the fake model samples for `request_id` at `position`: 10..1009, so
    never a small id (the tests use no EOS and no stop tokens anyway)."""
    x = (_rid_hash(request_id) * 0x9E3779B1 + position * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return x % 1000 + 10


def expected_tokens(request_id: str, prompt_len: int, max_tokens: int) -> list[int]:
    return [fake_token(request_id, p) for p in range(prompt_len, prompt_len + max_tokens)]


def sample_for(out: SchedulerOutput) -> dict[str, int]:
    """What ModelRunner.execute returns for this step: a token for every request
    whose step samples and, for a parent about to fork, for each sibling too."""
    sampled = {}
    for s in out.scheduled:
        if s.samples:
            pos = s.start + s.num_new_tokens
            for seq in (s.request, *s.request.pending_forks):
                sampled[seq.request_id] = fake_token(seq.request_id, pos)
    return sampled


def verify_drafts(s) -> list[int]:
    """The fake model verifying s's drafts: the drafts it agrees with, then its own
    token at the first disagreement (or after the last draft)."""
    rid, pos = s.request.request_id, s.request.num_tokens
    out = []
    for draft in s.spec_token_ids:
        if draft != fake_token(rid, pos + len(out)):
            break
        out.append(draft)
    return out + [fake_token(rid, pos + len(out))]


def _with_pending(s) -> list[int]:
    """The request's tokens as the device knows them: the known ones, then those the
    step still running is sampling (the fake model's, by position)."""
    req = s.request
    known = req.num_tokens
    return req.token_ids + [fake_token(req.request_id, known + j) for j in range(s.num_pending)]


# -- the fake device --------------------------------------------------------------

class FakeKV:
    """block id -> the token id held by each slot. Blocks the pool hands out get
    fresh junk (negative numbers, never a token), so reading a slot nobody wrote
    fails the comparison.

    The junk lands when the step runs, after its copies read their sources: in one
    step a block can be freed (a preempted sibling's last reference) and handed out
    again after a copy-on-write from it was queued; on the device the copy still
    runs before the forward pass writes into the block's new owner."""

    def __init__(self, kv: KVCacheManager):
        self.bs = kv.block_size
        self._junk = -1
        self.slots = [self._fresh() for _ in range(kv.num_blocks)]
        self.handed_out: list[int] = []  # this step's allocations, junked at run time
        pool = kv._pool
        allocate = pool.allocate

        def allocate_and_record(count):
            blocks = allocate(count)
            self.handed_out.extend(b.block_id for b in blocks)
            return blocks

        pool.allocate = allocate_and_record  # the manager calls self._pool.allocate

    def _fresh(self) -> list[int]:
        self._junk -= self.bs
        return list(range(self._junk, self._junk - self.bs, -1))

    def run_copies(self, copies) -> None:
        """The start of a step on the device: copies (in order, from what the
        sources held), then this step's new blocks hold junk outside the copies."""
        sources = [self.slots[c.src][:c.num_tokens] for c in copies]
        for block_id in self.handed_out:
            self.slots[block_id] = self._fresh()
        self.handed_out.clear()
        for c, data in zip(copies, sources):
            self.slots[c.dst][:c.num_tokens] = data

    def write(self, table: list[int], tokens: list[int], start: int, end: int) -> None:
        bs = self.bs
        for i in range(start // bs, (end - 1) // bs + 1):
            lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
            self.slots[table[i]][lo - i * bs:hi - i * bs] = tokens[lo:hi]

    def holds(self, table: list[int], tokens: list[int], start: int, end: int) -> bool:
        """Do the slots of positions [start, end) hold tokens[start:end]?"""
        bs = self.bs
        for i in range(start // bs, (end - 1) // bs + 1):
            lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
            if self.slots[table[i]][lo - i * bs:hi - i * bs] != tokens[lo:hi]:
                return False
        return True


# -- the workload -----------------------------------------------------------------

@dataclass
class Spec:
    request_id: str
    arrival_step: int
    prompt: list[int]
    max_tokens: int
    n: int = 1
    priority: int = 0
    cache_salt: str | None = None

    def seq_ids(self) -> list[str]:
        return [self.request_id] + [f"{self.request_id}#{i}" for i in range(1, self.n)]


def blocks_alone(spec: Spec, block_size: int) -> int:
    """Blocks the whole group needs at its longest when it runs alone: the parent's
    table plus, per sibling, the blocks past the shared full prompt blocks."""
    total = spec_len(spec)
    own = -(-total // block_size)
    return own + (spec.n - 1) * (own - len(spec.prompt) // block_size)


def spec_len(spec: Spec) -> int:
    return len(spec.prompt) + spec.max_tokens


def _log_uniform(rng: random.Random, hi: int) -> int:
    return min(hi, max(1, int(math.exp(rng.uniform(0, math.log(hi + 1))))))


def make_workload(num_requests: int, seed: int, *, arrival_span: int,
                  max_prompt: int = 4000, max_output: int = 500, n_fraction: float = 0.05,
                  shared_fraction: float = 0.35, num_priorities: int = 1,
                  max_blocks: int | None = None, block_size: int = 16) -> list[Spec]:
    """Random requests: prompt lengths 1..max_prompt and outputs 1..max_output,
    log-uniform (many short, some long) with both ends of each range always present;
    some share a prefix with a group (hits within one cache_salt, misses across),
    some repeat an earlier prompt outright, some are n=3. With max_blocks, a group
    that could not run alone in that many blocks is shortened (it could never run)."""
    rng = random.Random(seed)
    vocab = 50_000
    groups = [[rng.randrange(vocab) for _ in range(rng.randrange(block_size, 2000))]
              for _ in range(6)]
    salts = [None, "tenant-a", "tenant-b"]
    extremes = [(1, 1), (max_prompt, max_output), (1, max_output), (max_prompt, 1)]
    specs: list[Spec] = []
    for i in range(num_requests):
        if i < len(extremes):
            plen, out = extremes[i]
        else:
            plen, out = _log_uniform(rng, max_prompt), _log_uniform(rng, max_output)
        r = rng.random()
        if r < shared_fraction:
            head = rng.choice(groups)
            head = head[:rng.randrange(1, len(head) + 1)]
            prompt = (head + [rng.randrange(vocab) for _ in range(plen)])[:max(plen, 1)]
            salt = rng.choice(salts)
        elif r < shared_fraction + 0.05 and specs:
            prev = rng.choice(specs)
            prompt, salt = list(prev.prompt), prev.cache_salt
        else:
            prompt = [rng.randrange(vocab) for _ in range(plen)]
            salt = None
        n = 3 if rng.random() < n_fraction else 1
        spec = Spec(f"r{i}", rng.randrange(arrival_span), prompt, out, n,
                    rng.randrange(num_priorities), salt)
        if max_blocks is not None:
            while blocks_alone(spec, block_size) > max_blocks:
                spec.max_tokens = max(1, spec.max_tokens // 2)
                if spec.max_tokens == 1 and blocks_alone(spec, block_size) > max_blocks:
                    spec.n = 1
        specs.append(spec)
    specs.sort(key=lambda s: s.arrival_step)  # stable: ties keep their index order
    return specs


# -- the simulation ---------------------------------------------------------------

@dataclass
class SimResult:
    steps: int
    requests: dict[str, Request]  # every sequence, children included
    specs: dict[str, Spec]  # by parent id
    add_step: dict[str, int]
    add_index: dict[str, int]
    first_admit_step: dict[str, int]
    first_admit_seq: dict[str, int]  # global order of first admissions
    max_wait_bound: dict[str, int]  # per parent: the FCFS progress bound on its wait
    aborted: dict[str, str]  # request id -> kind of moment it was aborted at
    num_preemptions: int
    preempted_in_prefill: int  # before its first token
    preempted_in_decode: int  # after it
    readmissions_with_prefix_hit: int
    max_batched_tokens: int
    max_scheduled: int
    max_running_seqs: int
    forks: int
    copies: int
    empty_steps: int
    kv_checks: int
    counters: Counter = field(default_factory=Counter)


class Simulation:
    """Runs `specs` against a fresh Scheduler + KVCacheManager.

    abort_rate: chance per step of one abort, its kind drawn from ABORT_KINDS (a kind
    with no candidate at that moment is skipped). strict_service: assert that every
    running request not preempted is served in every step (only sound when the budget
    covers max_num_seqs chunks; see check_schedule)."""

    def __init__(self, specs: list[Spec], config: SchedulerConfig, num_blocks: int,
                 block_size: int = 16, *, enable_prefix_caching: bool = True,
                 abort_rate: float = 0.0, seed: int = 0, full_check_every: int = 50,
                 strict_service: bool | None = None, max_aborts: int = 10**9,
                 speculate: float = 0.0, overlap: bool = False):
        if overlap and speculate:
            raise ValueError("async scheduling does not speculate")
        for s in specs:
            if spec_len(s) > config.max_model_len:
                raise ValueError(f"{s.request_id} is longer than max_model_len")
            if blocks_alone(s, block_size) > num_blocks:
                raise ValueError(f"{s.request_id} could never run in {num_blocks} blocks")
            if s.n > config.max_num_seqs:
                raise ValueError(f"{s.request_id} has more sequences than max_num_seqs")
        self.specs = sorted(specs, key=lambda s: s.arrival_step)
        self.config = config
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, model_key="sim")
        self.sched = Scheduler(config, self.kv)
        self.dev = FakeKV(self.kv)
        self.bs = block_size
        self.rng = random.Random(seed)
        self.abort_rate = abort_rate
        # Chance per step that a decoding request carries 1..4 drafts, each right
        # (the fake model's own next token) with probability 0.6.
        self.speculate = speculate
        self.overlap = overlap
        self._inflight: tuple[SchedulerOutput, dict] | None = None  # overlap: step N
        self.max_aborts = max_aborts
        self.full_check_every = full_check_every
        cap = config.long_prefill_token_threshold or config.max_num_batched_tokens
        if strict_service is None:
            strict_service = config.max_num_batched_tokens >= config.max_num_seqs * cap
        self.strict_service = strict_service
        # Under fcfs a sound cap (the argument of max_wait_bound): every step either
        # moves the oldest running sequence, which is never preempted, by a token or
        # admits a sequence into an empty batch. Priority gets twice that as slack.
        work = sum((spec_len(s) + 1) * s.n for s in specs)
        self.step_cap = max(s.arrival_step for s in specs) + 1 + work
        if config.policy != "fcfs":
            self.step_cap *= 2

        self.step = 0
        self.reqs: dict[str, Request] = {}
        self.spec_of: dict[str, Spec] = {}
        self.add_step: dict[str, int] = {}
        self.add_index: dict[str, int] = {}
        self.first_admit_step: dict[str, int] = {}
        self.first_admit_seq: dict[str, int] = {}
        self.max_wait_bound: dict[str, int] = {}
        self.aborted: dict[str, str] = {}
        self.finished: set[str] = set()
        self.verified: set[str] = set()  # requests whose whole context was checked
        self.c = Counter()
        self.max_batched = self.max_scheduled = self.max_running = 0

    # -- the loop -----------------------------------------------------------------
    def run(self) -> SimResult:
        pending = list(self.specs)
        nxt = 0
        while nxt < len(pending) or self._busy():
            if not self._busy() and pending[nxt].arrival_step > self.step:
                self.step = pending[nxt].arrival_step  # idle: jump to the next arrival
            while nxt < len(pending) and pending[nxt].arrival_step <= self.step:
                self._add(pending[nxt])
                nxt += 1
            self._maybe_abort(mid_step=False)
            if self._busy():
                self._one_step()
            self.step += 1
            assert self.step <= self.step_cap, f"no progress: {self.step} steps"
        self._final_checks()
        return SimResult(
            steps=self.step, requests=self.reqs, specs={s.request_id: s for s in self.specs},
            add_step=self.add_step, add_index=self.add_index,
            first_admit_step=self.first_admit_step, first_admit_seq=self.first_admit_seq,
            max_wait_bound=self.max_wait_bound, aborted=self.aborted,
            num_preemptions=self.sched.num_preemptions,
            preempted_in_prefill=self.c["preempted_in_prefill"],
            preempted_in_decode=self.c["preempted_in_decode"],
            readmissions_with_prefix_hit=self.c["readmit_hit"],
            max_batched_tokens=self.max_batched, max_scheduled=self.max_scheduled,
            max_running_seqs=self.max_running, forks=self.c["forks"],
            copies=self.c["copies"], empty_steps=self.c["empty_steps"],
            kv_checks=self.c["kv_checks"], counters=self.c)

    def _add(self, spec: Spec) -> None:
        req = Request(spec.request_id, spec.prompt,
                      SamplingParams(max_tokens=spec.max_tokens, n=spec.n),
                      eos_token_ids=(), arrival_time=float(len(self.add_index)),
                      cache_salt=spec.cache_salt, priority=spec.priority)
        req.make_siblings()
        # The fcfs bound on this request's wait (the argument is in test_simulation's
        # check_fcfs_admission): all the work that requests added before it may
        # still need, a whole recompute each, plus one admission step each.
        self.max_wait_bound[spec.request_id] = sum(
            (spec_len(self.spec_of[rid]) + 1) * (1 + len(r.pending_forks))
            for rid, r in self.sched.requests.items())
        self.sched.add_request(req)
        self.add_index[spec.request_id] = len(self.add_index)
        self.add_step[spec.request_id] = self.step
        for seq in (req, *req.pending_forks):
            self.reqs[seq.request_id] = seq
            self.spec_of[seq.request_id] = spec

    def _busy(self) -> bool:
        return self.sched.has_unfinished() or self._inflight is not None

    def _one_step(self) -> None:
        """Engine.step(): schedule and execute a step, and update with the tokens of
        the step that completed (this one, or with overlap the one before)."""
        sched, previous = self.sched, self._inflight
        if previous is not None and any(s.samples and s.request.pending_forks
                                        for s in previous[0].scheduled):
            self._complete(*previous)  # siblings fork on the host first
            previous = self._inflight = None
            self.c["drains"] += 1
        running_before = list(sched.running)
        had_waiting = len(sched.waiting) > 0
        if self.speculate:
            self._propose_drafts()
        out = self._out = sched.schedule()
        self.check_schedule(out, running_before, had_waiting)
        launched = None
        if out.is_empty:  # the engine skips the runner and update()
            self.c["empty_steps"] += 1
            self.dev.run_copies([])  # nothing ran; whatever was handed out is junk
        else:
            launched = out, self._execute(out)
            self._maybe_abort(mid_step=True, out=out)
        if previous is not None:
            self._complete(*previous)
        self._inflight = launched if self.overlap else None
        if launched is not None and not self.overlap:
            self._complete(*launched)
        self.check_state()
        if self.step % self.full_check_every == 0:
            check_pool_invariants(self.kv, [r.request_id for r in sched.running])
            assert {id(r) for r in sched.waiting} == {
                id(r) for r in sched.requests.values() if r.status is RequestStatus.WAITING}

    def _complete(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """update() with a step's tokens."""
        sched = self.sched
        forking = {s.request.request_id: list(s.request.pending_forks)
                   for s in out.scheduled if s.request.pending_forks}
        changed = sched.update(out, sampled)
        for rid, kids in forking.items():
            if not self.reqs[rid].pending_forks:  # the parent sampled: kids forked
                self.c["forks"] += sum(k.finish_reason != "abort" for k in kids)
        for req in changed:
            if req.finished:
                self._on_finish(req)

    def _execute(self, out: SchedulerOutput) -> dict[str, int]:
        """What the device does: copies, then every new token's KV, then attention
        reads the whole context of each request (checked here)."""
        self.dev.run_copies(out.block_copies)
        self.c["copies"] += len(out.block_copies)
        copied = {c.dst for c in out.block_copies}
        for s in out.scheduled:
            end = s.start + s.num_new_tokens + len(s.spec_token_ids)
            self.dev.write(s.block_table, _with_pending(s) + s.spec_token_ids, s.start, end)
        full = self.step % self.full_check_every == 0
        for s in out.scheduled:
            req, end = s.request, s.start + s.num_new_tokens
            rid = req.request_id
            if full or rid not in self.verified or copied.intersection(s.block_table):
                lo = 0
                self.verified.add(rid)
                self.c["kv_checks"] += 1
            else:  # steady decode: the context was checked before; check the new block
                lo = (s.start // self.bs) * self.bs
            assert self.dev.holds(s.block_table, _with_pending(s), lo, end), (
                f"step {self.step}: {rid} reads wrong KV in [{lo}, {end}) "
                f"(table {s.block_table})")
        sampled = sample_for(out)
        for s in out.scheduled:
            if s.spec_token_ids:
                sampled[s.request.request_id] = verify_drafts(s)
                self.c["drafts"] += len(s.spec_token_ids)
                self.c["accepted"] += len(sampled[s.request.request_id]) - 1
        return sampled

    def _propose_drafts(self) -> None:
        for req in self.sched.running:
            if (req.num_tokens - req.num_computed_tokens == 1 and not req.pending_forks
                    and req.num_output_tokens and self.rng.random() < self.speculate):
                rid, pos = req.request_id, req.num_tokens
                req.spec_token_ids = [
                    fake_token(rid, pos + j) if self.rng.random() < 0.6 else 5
                    for j in range(self.rng.randint(1, 4))]

    # -- aborts ---------------------------------------------------------------------
    def _maybe_abort(self, mid_step: bool, out: SchedulerOutput | None = None) -> None:
        if len(self.aborted) >= self.max_aborts or self.rng.random() >= self.abort_rate:
            return
        kind = self.rng.choice(ABORT_KINDS)
        if (kind == "mid_step") != mid_step:
            return
        sched = self.sched
        if kind == "mid_step":
            pool = [s.request for s in out.scheduled]
        elif kind == "waiting":
            pool = [r for r in sched.requests.values()
                    if r.status is RequestStatus.WAITING and r.num_preemptions == 0]
        elif kind == "preempted":
            pool = [r for r in sched.requests.values()
                    if r.status is RequestStatus.WAITING and r.num_preemptions > 0]
        elif kind == "prefill":
            pool = [r for r in sched.running if r.num_computed_tokens < r.num_prompt_tokens]
        elif kind == "decode":
            pool = [r for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens]
        elif kind == "forking_parent":
            pool = [r for r in sched.requests.values() if r.pending_forks]
        else:  # "child": a forked sibling
            pool = [r for r in sched.running if "#" in r.request_id]
        pool = [r for r in pool if not r.finished]
        if not pool:
            return
        victim = pool[self.rng.randrange(len(pool))]
        siblings = list(victim.pending_forks)
        ended = sched.abort(victim.request_id)
        assert ended == [victim, *siblings], "abort ends the request and unforked siblings"
        for r in ended:
            self.aborted[r.request_id] = kind
            assert r.finished and r.finish_reason == "abort", r.request_id
            self.verified.discard(r.request_id)
        self.c[f"abort_{kind}"] += 1
        assert victim.request_id not in sched.requests
        assert victim not in sched.running
        assert all(w is not victim for w in sched.waiting)
        assert self.kv.block_table(victim.request_id) == []
        self.check_output_prefix(victim)

    # -- checks -------------------------------------------------------------------
    def check_schedule(self, out: SchedulerOutput, running_before: list[Request],
                       had_waiting: bool) -> None:
        cfg, sched, kv, bs = self.config, self.sched, self.kv, self.bs
        step = self.step
        total = out.num_batched_tokens
        assert total <= cfg.max_num_batched_tokens, f"step {step}: {total} tokens"
        assert len(out.scheduled) <= cfg.max_num_seqs, f"step {step}: too many seqs"
        self.max_batched = max(self.max_batched, total)
        self.max_scheduled = max(self.max_scheduled, len(out.scheduled))
        ids = [s.request.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids), f"step {step}: a request scheduled twice"
        before = {r.request_id for r in running_before}
        preempted = set(out.preempted)
        assert len(preempted) == len(out.preempted)
        assert preempted <= before, "only running requests are preempted"
        assert not preempted & set(ids), "a preempted request stays scheduled"
        admitted = [s.request for s in out.scheduled if s.request.request_id not in before]
        if preempted:
            assert not admitted, f"step {step}: preempted someone and admitted {admitted}"
        # running requests come first in the batch, in running order; newcomers after
        served = [s.request for s in out.scheduled if s.request.request_id in before]
        survivors = [r for r in running_before if r.request_id not in preempted]
        assert sched.running == survivors + admitted, f"step {step}: running list"
        # (overlap) a request whose last token is still on its way is left out
        survivors = [r for r in survivors if r in served or not self._ends_pending(r)]
        assert served == survivors[:len(served)], f"step {step}: running served out of order"
        assert [s.request for s in out.scheduled[:len(served)]] == served
        unserved = survivors[len(served):]
        if unserved:  # someone running got nothing: only when the budget ran out
            assert total == cfg.max_num_batched_tokens, (
                f"step {step}: {[r.request_id for r in unserved]} skipped with budget left")
            assert not self.strict_service, (
                f"step {step}: running {[r.request_id for r in unserved]} not served")
        if admitted:
            assert not unserved, f"step {step}: admitted before serving everyone running"
        cap = cfg.long_prefill_token_threshold
        for s in out.scheduled:
            req, n = s.request, s.num_new_tokens
            assert req.status is RequestStatus.RUNNING and not req.finished
            assert n >= 1, f"step {step}: {req.request_id} scheduled for 0 tokens"
            assert not cap or n <= cap, f"step {step}: {n} tokens > threshold {cap}"
            assert s.start + n <= req.num_tokens + req.num_pending_tokens
            assert s.num_pending == 0 or (self.overlap and s.num_pending == 1)
            assert s.block_table == kv.block_table(req.request_id), "stale block table"
            assert len(s.block_table) == -(-(s.start + n + len(s.spec_token_ids)) // bs), (
                f"step {step}: {req.request_id} table {len(s.block_table)} blocks for "
                f"{s.start + n} tokens")
            assert len(set(s.block_table)) == len(s.block_table)
        self.c["pending_fed"] += sum(s.num_pending for s in out.scheduled)
        self.c["left_to_finish"] += sum(1 for r in running_before if r not in served
                                        and r.request_id not in preempted
                                        and self._ends_pending(r))
        for rid in out.preempted:
            r = self.reqs[rid]
            assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0
            self.c["preempted_pending"] += r.num_pending_tokens
            assert kv.block_table(rid) == [], f"preempted {rid} keeps blocks"
            self.verified.discard(rid)
            was = next(x for x in running_before if x.request_id == rid)
            if len(was.output_token_ids) == 0:
                self.c["preempted_in_prefill"] += 1
            else:
                self.c["preempted_in_decode"] += 1
        if preempted:
            self._check_victims(running_before, preempted, survivors)
        active = [r for r in running_before if r in served or not self._ends_pending(r)]
        if active and cfg.policy == "fcfs":
            # Liveness: the oldest running request is never preempted and always
            # computes at least one token (it alone fits the pool).
            assert out.scheduled and out.scheduled[0].request is active[0], (
                f"step {step}: the oldest running request made no progress")
        elif not running_before and had_waiting:
            assert admitted, f"step {step}: nothing running, nothing admitted"
        if admitted and cfg.policy == "priority":
            # Head of line: nobody left waiting has a lower priority number than a
            # request admitted this step.
            best = min((r.priority for r in sched.requests.values()
                        if r.status is RequestStatus.WAITING), default=None)
            worst = max(r.priority for r in admitted)
            assert best is None or worst <= best, (
                f"step {step}: admitted priority {worst} while priority {best} waits")
        for r in admitted:
            self._on_admit(r)

    def _ends_pending(self, req: Request) -> bool:
        """Overlap: its pending token ends it (by length), so it is not scheduled."""
        return req.num_pending_tokens > 0 and self.sched._ends_with_pending(req)

    def _check_victims(self, running_before, preempted, survivors) -> None:
        # (overlap) requests finishing with the token on its way are never victims:
        # their blocks are freed first, and preempting them would free nothing.
        running_before = [r for r in running_before
                          if r.request_id in preempted or not self._ends_pending(r)]
        survivors = [r for r in survivors if not self._ends_pending(r)]
        if self.config.policy == "fcfs":  # the latest admitted go first
            k = len(preempted)
            assert {r.request_id for r in running_before[-k:]} == preempted, (
                f"step {self.step}: fcfs victims are not the latest admitted")
        else:  # lowest priority, then latest arrival
            worst_kept = max(((r.priority, r.arrival_time) for r in survivors), default=None)
            for rid in preempted:
                r = self.reqs[rid]
                assert worst_kept is None or (r.priority, r.arrival_time) >= worst_kept, (
                    f"step {self.step}: preempted {rid} over a lower-priority request")

    def _on_admit(self, req: Request) -> None:
        rid = req.request_id
        start = next(s.start for s in self._out.scheduled if s.request is req)
        if rid in self.add_index and rid not in self.first_admit_step:  # not a fork
            self.first_admit_step[rid] = self.step
            self.first_admit_seq[rid] = len(self.first_admit_seq)
            if start:
                self.c["first_admit_hit"] += 1
        elif start:
            self.c["readmit_hit"] += 1
        self.c["admissions"] += 1

    def check_state(self) -> None:
        """After update(): the scheduler's and the pool's books agree."""
        sched, kv, bs = self.sched, self.kv, self.bs
        running_ids = [r.request_id for r in sched.running]
        waiting = [r for r in sched.requests.values() if r.status is RequestStatus.WAITING]
        waiting_ids = [r.request_id for r in waiting]
        assert len(sched.waiting) == len(waiting), "waiting queue vs request states"
        assert len(set(running_ids)) == len(running_ids)
        assert not set(running_ids) & set(waiting_ids)
        assert set(sched.requests) == set(running_ids) | set(waiting_ids), "requests map"
        seqs = len(sched.running) + sum(len(r.pending_forks) for r in sched.running)
        assert seqs <= self.config.max_num_seqs, f"step {self.step}: {seqs} sequences"
        self.max_running = max(self.max_running, seqs)
        used = set()
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            assert r.num_computed_tokens < r.num_tokens + r.num_pending_tokens, (
                "a running request with no work")
            assert r.num_pending_tokens == (self._inflight is not None and any(
                s.request is r and s.samples for s in self._inflight[0].scheduled))
            table = kv.block_table(r.request_id)
            # the table covers exactly the computed tokens: nothing short, nothing leaked
            assert len(table) == -(-r.num_computed_tokens // bs), (
                f"step {self.step}: {r.request_id} holds {len(table)} blocks for "
                f"{r.num_computed_tokens} computed tokens")
            used.update(table)
            if self.speculate:
                self._check_hashes(r)
        for r in waiting:
            assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0
            assert r.num_pending_tokens == 0
            assert kv.block_table(r.request_id) == []
        assert kv.num_free_blocks + len(used) == kv.num_blocks, (
            f"step {self.step}: {kv.num_free_blocks} free + {len(used)} used "
            f"!= {kv.num_blocks}")

    def _check_hashes(self, req: Request) -> None:
        """The request's hash chain is what a request that never saw a rejected
        draft would have: full blocks of its own verified tokens, none beyond."""
        blocks = self.kv._requests[req.request_id]
        assert len(blocks.hashes) <= req.num_computed_tokens // self.bs, (
            f"step {self.step}: {req.request_id} hashes past its verified tokens")
        chain = self.kv._hasher.hash_blocks(blocks.root_hash, req.token_ids, 0,
                                            len(blocks.hashes))
        assert blocks.hashes == chain, f"step {self.step}: {req.request_id} hash chain"

    def check_output_prefix(self, req: Request) -> None:
        spec = self.spec_of[req.request_id]
        exp = expected_tokens(req.request_id, len(spec.prompt), spec.max_tokens)
        got = req.output_token_ids
        assert got == exp[:len(got)], f"{req.request_id}: wrong tokens"

    def _on_finish(self, req: Request) -> None:
        rid = req.request_id
        spec = self.spec_of[rid]
        assert req.finish_reason == "length", (rid, req.finish_reason)
        assert req.output_token_ids == expected_tokens(rid, len(spec.prompt),
                                                       spec.max_tokens), f"{rid}: wrong tokens"
        assert rid not in self.sched.requests and req not in self.sched.running
        assert self.kv.block_table(rid) == []
        self.finished.add(rid)
        self.verified.discard(rid)

    def _final_checks(self) -> None:
        sched, kv = self.sched, self.kv
        assert not sched.running and not len(sched.waiting) and not sched.requests
        assert not sched.groups, "request groups leaked"
        for rid, req in self.reqs.items():
            assert req.finished, f"{rid} never finished"
            assert (rid in self.aborted) != (rid in self.finished), rid
        assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
        check_pool_invariants(kv, [])
