"""Unit tests pinning the scheduler's rules, one small scene each (no model: the fake
runner of tests/scheduler/sim.py gives the tokens)."""
from __future__ import annotations

import zlib

import pytest

from kvserve.kvcache import KVCacheManager
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.output import SchedulerOutput
from kvserve.scheduler.request import Request, RequestStatus
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.waiting_queue import FCFSQueue, PriorityQueue, make_waiting_queue
from tests.kvcache.kvcache_sim import check_pool_invariants
from tests.scheduler.sim import expected_tokens, sample_for

_next_arrival = iter(range(10**9))


def make(num_blocks: int = 64, block_size: int = 4, caching: bool = True,
         **config) -> Scheduler:
    config.setdefault("max_model_len", 1000)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size, caching))


def req(rid: str, prompt_len: int, max_tokens: int = 8, *, n: int = 1, priority: int = 0,
        base: int = 0) -> Request:
    """Prompt tokens are consecutive from a start derived from the id: distinct per
    request (no accidental prefix hits) unless `base` is shared on purpose."""
    start = base if base else 1000 * (zlib.crc32(rid.encode()) % 100_000) + 100_000
    r = Request(rid, list(range(start, start + prompt_len)),
                SamplingParams(max_tokens=max_tokens, n=n), eos_token_ids=(),
                arrival_time=float(next(_next_arrival)), priority=priority)
    r.make_siblings()
    return r


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(id, start, num_new_tokens, samples) per scheduled request; start and samples
    read the request, so take this before update()."""
    return [(x.request.request_id, x.start, x.num_new_tokens, x.samples) for x in out.scheduled]


def step(s: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with the fake runner; out.plan is plan(out) before update."""
    out = s.schedule()
    out.plan = plan(out)
    return out, s.update(out, sample_for(out))


def run_all(s: Scheduler, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        step(s)
    raise AssertionError("did not finish")


def assert_empty(s: Scheduler) -> None:
    assert not s.running and not len(s.waiting) and not s.requests and not s.groups
    assert s.kv.num_free_blocks == s.kv.num_blocks
    check_pool_invariants(s.kv, [])


def expected(r: Request) -> list[int]:
    return expected_tokens(r.request_id, r.num_prompt_tokens, r.params.max_tokens)


# -- chunked prefill and the token budget -----------------------------------------

def test_chunked_prefill_splits_a_prompt_by_the_budget_and_only_the_last_chunk_samples():
    s = make(max_num_batched_tokens=8)
    a = req("a", 20, max_tokens=3)
    s.add_request(a)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        chunks.append(plan(out))
        changed = s.update(out, sample_for(out))
        assert changed == ([a] if chunks[-1][0][3] else [])
    assert chunks == [[("a", 0, 8, False)], [("a", 8, 8, False)], [("a", 16, 4, True)]]
    assert a.output_token_ids == expected(a)[:1]
    out, _ = step(s)
    assert out.plan == [("a", 20, 1, True)]  # then one token a step
    run_all(s)
    assert a.output_token_ids == expected(a) and a.finish_reason == "length"
    assert_empty(s)


def test_a_prompt_chunk_takes_what_the_running_decodes_leave_of_the_budget():
    s = make(max_num_batched_tokens=8)
    a, b = req("a", 3, max_tokens=20), req("b", 20)
    s.add_request(a)
    step(s)
    s.add_request(b)
    out, _ = step(s)
    assert out.plan == [("a", 3, 1, True), ("b", 0, 7, False)]  # running first
    out, _ = step(s)
    assert out.plan == [("a", 4, 1, True), ("b", 7, 7, False)]
    assert out.num_batched_tokens == 8


def test_long_prefill_token_threshold_caps_every_request_per_step():
    s = make(max_num_batched_tokens=100, long_prefill_token_threshold=5)
    a, b = req("a", 12, max_tokens=4), req("b", 3, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    steps = []
    while s.has_unfinished():
        out, _ = step(s)
        assert all(x.num_new_tokens <= 5 for x in out.scheduled)
        steps.append(out.plan)
    assert steps[:3] == [
        [("a", 0, 5, False), ("b", 0, 3, True)],
        [("a", 5, 5, False), ("b", 3, 1, True)],
        [("a", 10, 2, True), ("b", 4, 1, True)],
    ]
    assert a.output_token_ids == expected(a) and b.output_token_ids == expected(b)


def test_budget_and_max_num_seqs_bound_every_step():
    s = make(num_blocks=200, max_num_batched_tokens=16, max_num_seqs=3)
    reqs = [req(f"r{i}", 5 + 3 * i, max_tokens=6) for i in range(7)]
    for r in reqs:
        s.add_request(r)
    while s.has_unfinished():
        out, _ = step(s)
        assert out.num_batched_tokens <= 16
        assert len(out.scheduled) <= 3 and len(s.running) <= 3
    assert all(r.output_token_ids == expected(r) for r in reqs)
    assert_empty(s)


# -- preemption -----------------------------------------------------------------

def three_full_blocks(policy: str = "fcfs", priorities=(0, 0, 0)) -> tuple[Scheduler, list]:
    """4 blocks of 4 tokens; a, b, c each hold one full prompt block and have
    sampled, so each needs a fresh block for its next token: only one is left."""
    s = make(num_blocks=4, max_num_batched_tokens=64, policy=policy)
    reqs = [req(name, 4, max_tokens=6, priority=p) for name, p in zip("abc", priorities)]
    for r in reqs:
        s.add_request(r)
    step(s)
    assert s.running == reqs and s.kv.num_free_blocks == 1
    return s, reqs


def test_fcfs_preempts_the_latest_admitted_request():
    s, (a, b, c) = three_full_blocks()
    out, _ = step(s)
    assert out.preempted == ["c"]
    assert out.plan == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert s.running == [a, b] and s.num_preemptions == 1


def test_priority_preempts_the_lowest_priority_then_the_latest_arrival():
    s = make(num_blocks=4, max_num_batched_tokens=64, policy="priority")
    x = req("x", 4, priority=0)
    y = req("y", 4, priority=2)
    z = req("z", 4, priority=2)
    w = req("w", 4, priority=1)
    for r in (x, y, z, w):
        s.add_request(r)
    step(s)
    assert s.running == [x, w, y, z]  # admitted in priority order
    out, _ = step(s)
    # x needs a block: z (priority 2, arrived after y) goes; then w needs one: y goes
    assert out.preempted == ["z", "y"]
    assert out.plan == [("x", 4, 1, True), ("w", 4, 1, True)]


def test_a_preempted_request_goes_back_to_the_head_and_keeps_its_tokens():
    s, (a, b, c) = three_full_blocks()
    d = req("d", 2)
    s.add_request(d)
    before = list(c.output_token_ids)
    out, _ = step(s)
    assert out.preempted == ["c"]
    assert c.status is RequestStatus.WAITING and c.num_preemptions == 1
    assert c.num_computed_tokens == 0 and s.kv.block_table("c") == []
    assert c.output_token_ids == before and len(before) == 1
    assert list(s.waiting) == [c, d]  # ahead of the newer d
    admitted = []
    while s.has_unfinished():
        running = set(map(id, s.running))
        out, _ = step(s)
        admitted += [x.request.request_id for x in out.scheduled if id(x.request) not in running]
    assert admitted.index("c") < admitted.index("d")
    for r in (a, b, c, d):  # recomputed from its prompt and its own tokens: same output
        assert r.output_token_ids == expected(r) and r.finish_reason == "length"
    assert_empty(s)


def test_a_preempted_request_is_recomputed_from_its_prefix_cache_hits():
    s = make(num_blocks=5, max_num_batched_tokens=64)
    a, b, c = req("a", 4, max_tokens=4), req("b", 4, max_tokens=4), req("c", 6, max_tokens=4)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # a: 1 block, b: 1, c: 2 (one full, one partial); 1 free
    out, _ = step(s)
    assert out.preempted == ["c"]  # its partial block goes to b, its full one stays cached
    while "c" not in [x.request.request_id for x in out.scheduled]:
        out, _ = step(s)
    start = next(p[1] for p in out.plan if p[0] == "c")
    assert start == 4  # the prompt block is a hit: only the rest is recomputed
    assert c.num_cached_tokens == 0  # counts the first admission's hits only
    run_all(s)
    assert c.output_token_ids == expected(c)
    assert_empty(s)


def test_nobody_is_preempted_to_admit_a_newcomer():
    s = make(num_blocks=2, block_size=8, max_num_batched_tokens=64)
    a, b = req("a", 3, max_tokens=5), req("b", 3, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert s.kv.num_free_blocks == 0
    c = req("c", 3)
    s.add_request(c)
    for _ in range(4):  # a and b decode inside their own blocks; c waits
        out, _ = step(s)
        assert not out.preempted
        assert [x.request for x in out.scheduled] == [a, b]
    assert list(s.waiting) == [c] and s.num_preemptions == 0
    run_all(s)
    assert c.output_token_ids == expected(c)
    assert_empty(s)


def test_admission_is_head_of_line():
    s = make(num_blocks=4, max_num_batched_tokens=64)
    a = req("a", 8, max_tokens=20)
    s.add_request(a)
    step(s)  # a holds 2 full blocks + 1 for its next token soon
    big, small = req("big", 12), req("small", 2)
    s.add_request(big)
    s.add_request(small)
    out, _ = step(s)
    # big needs 3 blocks, 1 is free: small would fit but must not jump the queue
    assert [x.request for x in out.scheduled] == [a]
    assert list(s.waiting) == [big, small]


def test_a_request_preempted_after_it_was_scheduled_gives_its_tokens_back():
    s = make(num_blocks=6, max_num_batched_tokens=64, policy="priority",
             long_prefill_token_threshold=6)
    low = req("low", 19, max_tokens=5, priority=5)
    s.add_request(low)
    step(s)  # low: [0, 6)
    high = req("high", 4, max_tokens=3, priority=0)
    s.add_request(high)
    out, _ = step(s)
    assert out.plan == [("low", 6, 6, False), ("high", 0, 4, True)]
    out, _ = step(s)
    # low took the last 2 blocks for [12, 18), then high needed one: low (worse
    # priority, earlier in the batch) is preempted and its 6 tokens leave the batch
    assert out.preempted == ["low"]
    assert out.plan == [("high", 4, 1, True)] and out.num_batched_tokens == 1


def test_blocks_of_a_step_taken_back_are_not_prefix_hits():
    """Regression: blocks are registered for sharing when allocated. When a victim
    already scheduled in this step is preempted its new blocks were never computed;
    they used to stay cached, and its own readmission hit KV nobody wrote."""
    s = make(num_blocks=6, max_num_batched_tokens=64, policy="priority",
             long_prefill_token_threshold=6)
    low = req("low", 19, max_tokens=5, priority=5)
    s.add_request(low)
    step(s)
    high = req("high", 4, max_tokens=3, priority=0)
    s.add_request(high)
    step(s)
    out, _ = step(s)
    assert out.preempted == ["low"]  # computed [0, 12); [12, 16) was hashed, not written
    while "low" not in [x.request.request_id for x in out.scheduled]:
        out, _ = step(s)
    start = next(p[1] for p in out.plan if p[0] == "low")
    assert start == 12, "readmitted on a cached block that was never computed"
    run_all(s)
    assert_empty(s)


def test_a_request_that_preempts_itself_does_not_stall_the_others():
    """Priority: the request that needs a block ranks lowest, so it is its own
    victim; the better requests after it in the batch are still served that step."""
    s = make(num_blocks=3, max_num_batched_tokens=64, policy="priority")
    low = req("low", 3, max_tokens=10, priority=5)
    s.add_request(low)
    step(s)
    hi1, hi2 = req("hi1", 2, priority=0), req("hi2", 2, priority=0)
    s.add_request(hi1)
    s.add_request(hi2)
    step(s)  # low fills its block; hi1 and hi2 take the other two
    assert s.running == [low, hi1, hi2] and s.kv.num_free_blocks == 0
    out, _ = step(s)  # low needs a fourth block
    assert out.preempted == ["low"]
    assert out.plan == [("hi1", 2, 1, True), ("hi2", 2, 1, True)]


def test_priority_ties_preempt_the_latest_admitted_so_siblings_cannot_cycle():
    """Regression: siblings share their prompt's priority and arrival time, and the
    victim was the first of equals in the batch, the one furthest along; every
    sibling in turn was recomputed before it could finish (a livelock, with prefix
    caching off so each recompute costs in full)."""
    s = make(num_blocks=30, block_size=1, caching=False, policy="priority",
             max_num_batched_tokens=3, long_prefill_token_threshold=1, max_num_seqs=4)
    g = req("g", 17, max_tokens=10, n=3)  # one sequence alone: 27 blocks
    seqs = [g, *g.pending_forks]
    s.add_request(g)
    victims = []
    for _ in range(1000):
        if not s.has_unfinished():
            break
        running = list(s.running)
        out, _ = step(s)
        if out.preempted and not victims:
            assert out.preempted == [running[-1].request_id]  # the latest admitted
        victims += out.preempted
    assert not s.has_unfinished() and victims
    for r in seqs:
        assert r.output_token_ids == expected(r) and r.finish_reason == "length"
    assert_empty(s)


# -- abort ------------------------------------------------------------------------

@pytest.mark.parametrize("moment", ["waiting", "running", "mid_prefill", "preempted",
                                    "mid_step"])
def test_abort_frees_everything_at_any_moment(moment):
    if moment == "preempted":
        s, (a, b, c) = three_full_blocks()
        step(s)
        victim = c
        assert victim.num_preemptions == 1 and victim.status is RequestStatus.WAITING
    else:
        s = make(num_blocks=16, max_num_batched_tokens=8)
        victim, other = req("v", 20), req("o", 5)
        s.add_request(other)
        s.add_request(victim)
        if moment in ("running", "mid_prefill", "mid_step"):
            step(s)
            if moment == "running":
                run_steps = 0
                while victim.num_output_tokens == 0:
                    step(s)
                    run_steps += 1
                assert run_steps > 0
            else:
                assert 0 < victim.num_computed_tokens < victim.num_prompt_tokens
    out = s.schedule() if moment == "mid_step" else None
    if moment == "mid_step":
        assert victim in [x.request for x in out.scheduled]
        sampled = sample_for(out)
    tokens = list(victim.output_token_ids)
    assert s.abort(victim.request_id) == [victim]
    if out is not None:
        s.update(out, sampled)  # the step that ran skips it
    assert victim.finish_reason == "abort" and victim.finished
    assert victim.output_token_ids == tokens
    assert victim.request_id not in s.requests and victim not in s.running
    assert victim not in list(s.waiting) and s.kv.block_table(victim.request_id) == []
    assert s.abort(victim.request_id) == []  # twice, or unknown: nothing
    run_all(s)
    assert_empty(s)


def test_aborting_a_parent_before_it_forks_aborts_its_siblings():
    s = make(max_num_batched_tokens=4)
    p = req("p", 10, n=3)
    s.add_request(p)
    step(s)  # mid-prompt: nothing forked yet
    kids = list(p.pending_forks)
    assert [k.request_id for k in kids] == ["p#1", "p#2"]
    assert s.abort("p#1") == []  # not a request of the scheduler yet
    assert s.abort("p") == [p, *kids]
    assert all(r.finish_reason == "abort" for r in (p, *kids))
    assert p.pending_forks == []
    assert_empty(s)


def test_aborting_a_forked_parent_leaves_its_siblings_running():
    s = make()
    p = req("p", 6, max_tokens=5, n=3)
    kids = list(p.pending_forks)
    s.add_request(p)
    step(s)  # the prompt is done: forked
    assert s.abort("p") == [p]
    assert s.running == kids
    run_all(s)
    for k in kids:
        assert k.output_token_ids == expected(k) and k.finish_reason == "length"
    assert_empty(s)


def test_aborting_a_request_ends_all_its_sequences_forked_or_not():
    s = make(max_num_batched_tokens=4)
    mid_prompt, forked = req("a", 10, n=3), req("b", 3, max_tokens=9, n=3)
    s.add_request(forked)
    s.add_request(mid_prompt)
    step(s)
    step(s)  # b's prompt is done and forked; a's still is not
    assert len(s.running) == 4 and mid_prompt.pending_forks
    for group, members in (("a", 3), ("b", 3)):
        ended = s.abort_request(group)
        assert len(ended) == members and all(r.finish_reason == "abort" for r in ended)
        assert {r.index for r in ended} == {0, 1, 2} and {r.group_id for r in ended} == {group}
    assert s.abort_request("a") == [] and s.abort_request("unknown") == []
    assert_empty(s)


def test_a_stop_string_ends_one_sequence_of_a_request():
    s = make()
    p = req("p", 3, max_tokens=9, n=3)
    kids = list(p.pending_forks)
    s.add_request(p)
    step(s)  # forked
    assert s.abort_request("p", index=1, reason="stop") == [kids[0]]
    assert kids[0].finish_reason == "stop" and s.running == [p, kids[1]]
    assert s.abort_request("p", index=1) == []  # already ended
    run_all(s)
    assert p.finish_reason == kids[1].finish_reason == "length"
    assert_empty(s)


# -- n > 1 ------------------------------------------------------------------------

def test_n_siblings_fork_on_the_first_sample_and_each_gets_its_own_token():
    s = make(num_blocks=32, max_num_batched_tokens=4)
    p = req("p", 6, max_tokens=4, n=3)
    kids = list(p.pending_forks)
    s.add_request(p)
    out, changed = step(s)  # [0, 4): no sample, no fork
    assert out.plan == [("p", 0, 4, False)] and changed == []
    assert p.pending_forks == kids and s.running == [p]
    out = s.schedule()
    sampled = sample_for(out)
    assert set(sampled) == {"p", "p#1", "p#2"}
    assert len(set(sampled.values())) == 3  # the fake model differs per sequence
    changed = s.update(out, sampled)
    assert changed == [*kids, p]
    assert s.running == [p, *kids] and p.pending_forks == []
    for r in (p, *kids):
        assert r.output_token_ids == [sampled[r.request_id]]
        assert r.num_computed_tokens == 6 and r.status is RequestStatus.RUNNING
        assert s.kv.block_table(r.request_id) == s.kv.block_table("p")  # all shared
        assert s.requests[r.request_id] is r
    assert [k.index for k in kids] == [1, 2]
    check_pool_invariants(s.kv, ["p", "p#1", "p#2"])
    out, _ = step(s)  # each writes position 6 into the shared half-full block
    assert len(out.block_copies) == 2  # copy-on-write for two, the last owns it
    assert len({tuple(x.block_table) for x in out.scheduled}) == 3
    run_all(s)
    for r in (p, *kids):
        assert r.output_token_ids == expected(r) and r.finish_reason == "length"
    assert_empty(s)


def test_max_num_seqs_counts_the_siblings_of_an_n_group():
    s = make(max_num_seqs=4, max_num_batched_tokens=64)
    a, g, c = req("a", 3), req("g", 3, n=3), req("c", 3)
    for r in (a, g, c):
        s.add_request(r)
    out, _ = step(s)
    # a (1) + g with its two siblings (3) = 4: c must wait, or g's fork makes 5
    assert [x.request for x in out.scheduled] == [a, g]
    assert len(s.running) == 4 and list(s.waiting) == [c]


def test_max_num_seqs_counts_siblings_of_a_running_parent_still_in_its_prompt():
    """Regression: siblings of a running parent that has not forked yet were not
    counted, so requests admitted behind it overflowed max_num_seqs at the fork."""
    s = make(max_num_seqs=4, max_num_batched_tokens=8, long_prefill_token_threshold=4)
    g, a, b = req("g", 8, n=3), req("a", 2), req("b", 2)
    for r in (g, a, b):
        s.add_request(r)
    out, _ = step(s)
    assert out.plan == [("g", 0, 4, False), ("a", 0, 2, True)]  # b waits for a seat
    while s.has_unfinished():
        step(s)
        assert len(s.running) + sum(len(r.pending_forks) for r in s.running) <= 4
        assert len(s.running) <= 4


def test_an_n_group_waits_for_seats_for_all_its_sequences():
    s = make(max_num_seqs=4, max_num_batched_tokens=64)
    a, b, g = req("a", 3, max_tokens=3), req("b", 3, max_tokens=3), req("g", 3, n=3)
    for r in (a, b, g):
        s.add_request(r)
    out, _ = step(s)
    assert [x.request for x in out.scheduled] == [a, b]  # 2 + 3 > 4
    while g.status is RequestStatus.WAITING:
        step(s)
    assert a.finished and b.finished
    run_all(s)
    assert all(r.output_token_ids == expected(r) for r in (a, b, g))


def test_a_parent_preempted_in_its_prompt_still_forks_later():
    s = make(num_blocks=8, max_num_batched_tokens=3)
    a = req("a", 4, max_tokens=16)
    s.add_request(a)
    step(s)
    p = req("p", 20, max_tokens=3, n=3)
    s.add_request(p)
    while p.num_preemptions == 0:
        step(s)
        assert p.pending_forks, "forked before its prompt was done"
    assert len(p.pending_forks) == 2 and p.status is RequestStatus.WAITING
    kids = list(p.pending_forks)
    run_all(s)
    for r in (a, p, *kids):
        assert r.output_token_ids == expected(r) and r.finish_reason == "length"
    assert_empty(s)


# -- the waiting queues -------------------------------------------------------------

def test_priority_queue_orders_by_priority_then_arrival_and_preempted_first():
    q = PriorityQueue()
    r = {name: req(name, 1, priority=p) for name, p in
         [("a", 1), ("b", 0), ("c", 1), ("d", 2), ("e", 0)]}
    for name in "abcde":
        q.push(r[name])
    assert [x.request_id for x in q] == ["b", "e", "a", "c", "d"]
    assert q.peek() is r["b"] and len(q) == 5
    back = req("back", 1, priority=1)
    q.push_front(back)  # the head of its class, still behind every priority 0
    assert [x.request_id for x in q] == ["b", "e", "back", "a", "c", "d"]
    q.push_front(r2 := req("back2", 1, priority=1))  # the latest preempted leads
    assert [x.request_id for x in q][:4] == ["b", "e", "back2", "back"]
    q.remove(r["a"])
    popped = [q.pop().request_id for _ in range(len(q))]
    assert popped == ["b", "e", "back2", "back", "c", "d"] and r2.priority == 1
    assert len(q) == 0


def test_fcfs_queue_orders_by_arrival_and_preempted_first():
    q = FCFSQueue()
    a, b, c = req("a", 1, priority=9), req("b", 1), req("c", 1, priority=-9)
    q.push(a)
    q.push(b)
    q.push_front(c)
    assert list(q) == [c, a, b] and q.peek() is c  # priority is ignored
    q.remove(a)
    assert [q.pop(), q.pop()] == [c, b]


def test_priority_policy_admits_in_priority_order_and_ties_by_arrival():
    s = make(max_num_seqs=1, policy="priority")
    reqs = [req("late-low", 2, 2, priority=3), req("mid", 2, 2, priority=1),
            req("urgent", 2, 2, priority=-1), req("mid2", 2, 2, priority=1)]
    for r in reqs:
        s.add_request(r)
    order = []
    while s.has_unfinished():
        running = set(map(id, s.running))
        out, _ = step(s)
        order += [x.request.request_id for x in out.scheduled if id(x.request) not in running]
    assert order == ["urgent", "mid", "mid2", "late-low"]


def test_bad_configuration_and_duplicates_are_refused():
    with pytest.raises(ValueError):
        make_waiting_queue("lifo")
    with pytest.raises(ValueError):
        make(policy="lifo")
    with pytest.raises(ValueError):
        make(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        make(max_num_seqs=0)
    s = make()
    s.add_request(req("a", 2))
    with pytest.raises(ValueError):
        s.add_request(req("a", 3))
