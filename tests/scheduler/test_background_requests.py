"""Background requests (batch jobs' lines) under both policies: they wait behind
every interactive request, their prompts yield a step's budget to interactive
prompts that wait, they are preempted first, and none of it can stall the engine."""
from __future__ import annotations

import pytest

from kvserve.scheduler.request import RequestStatus
from kvserve.scheduler.waiting_queue import make_waiting_queue
from tests.scheduler.test_scheduler_unit import assert_empty, expected, make, req, run_all, step


def background(r):
    r.background = True
    for child in r.pending_forks:
        child.background = True
    return r


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_waiting_background_requests_come_after_every_interactive_one(policy):
    q = make_waiting_queue(policy)
    b1, b2 = background(req("b1", 4)), background(req("b2", 4))
    i1, i2 = req("i1", 4, priority=5), req("i2", 4, priority=9)
    for r in (b1, i1, b2, i2):
        q.push(r)
    assert list(q) == [i1, i2, b1, b2] and len(q) == 4
    assert q.pop() is i1 and q.peek() is i2
    q.remove(b2)
    q.push_front(b2)  # as if preempted: head of its own class, still behind i2
    assert list(q) == [i2, b2, b1]
    q.remove(b1)
    assert [q.pop(), q.pop()] == [i2, b2] and not q


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_interactive_request_is_admitted_before_background_ones_that_came_first(policy):
    s = make(max_num_batched_tokens=64, max_num_seqs=2, policy=policy)
    lines = [background(req(f"b{i}", 4)) for i in range(3)]
    for r in lines:
        s.add_request(r)
    user = req("user", 4)
    s.add_request(user)
    out, _ = step(s)
    assert [x[0] for x in out.plan] == ["user", "b0"]
    run_all(s)
    for r in (*lines, user):
        assert r.output_token_ids == expected(r)
    assert_empty(s)


def test_a_background_prompt_yields_the_step_to_interactive_requests():
    # Budget 8: the batch line's 20-token prompt is chunked; the user's prompt comes
    # while it is half done and takes the next step's budget, the line waiting a step;
    # then the line's chunks leave a token for the user's decode behind it.
    s = make(max_num_batched_tokens=8, long_prefill_token_threshold=0)
    line = background(req("line", 20))
    s.add_request(line)
    out, _ = step(s)
    assert out.plan == [("line", 0, 8, False)]
    user = req("user", 6)
    s.add_request(user)
    out, _ = step(s)
    assert out.plan == [("user", 0, 6, True)]  # not the line's next chunk
    out, _ = step(s)  # nobody waits now: the line goes on, leaving the user a token
    assert out.plan == [("line", 8, 7, False), ("user", 6, 1, True)]
    run_all(s)
    assert line.output_token_ids == expected(line) and user.output_token_ids == expected(user)
    assert_empty(s)


def test_a_background_prompt_is_not_held_when_the_interactive_one_cannot_get_in():
    # The user's request finds no seat (max_num_seqs=1, the line holds it): holding
    # the line back would leave the step empty forever, so it goes on.
    s = make(max_num_batched_tokens=8, max_num_seqs=1)
    line = background(req("line", 20, max_tokens=2))
    s.add_request(line)
    step(s)
    user = req("user", 6)
    s.add_request(user)
    out, _ = step(s)
    assert out.plan == [("line", 8, 8, False)]
    run_all(s)
    assert user.output_token_ids == expected(user)
    assert_empty(s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_background_requests_are_preempted_before_interactive_ones(policy):
    # 4 blocks of 4: a (interactive), b (background), c (interactive) each hold a
    # full block and need a new one; one is free. b goes, though c came later.
    s = make(num_blocks=4, max_num_batched_tokens=64, policy=policy)
    a, b, c = req("a", 4, max_tokens=6), background(req("b", 4, max_tokens=6)), \
        req("c", 4, max_tokens=6)
    for r in (a, b, c):
        s.add_request(r)
    step(s)
    out, _ = step(s)
    assert out.preempted == ["b"]
    assert b.status is RequestStatus.WAITING
    run_all(s)
    for r in (a, b, c):
        assert r.output_token_ids == expected(r)
    assert_empty(s)


def test_background_prompts_take_a_small_share_of_steps_while_interactive_ones_run():
    # background_prefill_tokens=4: beside the user's decodes a line computes at most
    # 4 prompt tokens a step (short steps for the user); alone, the whole budget.
    s = make(max_num_batched_tokens=16, background_prefill_tokens=4)
    user = req("user", 3, max_tokens=6)
    s.add_request(user)
    step(s)
    a, b = background(req("a", 10)), background(req("b", 10))
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert out.plan == [("user", 3, 1, True), ("a", 0, 4, False)]
    out, _ = step(s)
    assert out.plan == [("user", 4, 1, True), ("a", 4, 4, False)]
    prompts = {"a": 10, "b": 10}
    while not user.finished:
        out, _ = step(s)  # their decodes are not counted: a token each, as the user's
        assert sum(max(0, min(n, prompts[rid] - start))
                   for rid, start, n, _ in out.plan if rid != "user") <= 4
    c = background(req("c", 30))
    s.add_request(c)
    run_all(s)
    for r in (user, a, b, c):
        assert r.output_token_ids == expected(r)
    assert_empty(s)


def test_alone_background_prompts_take_the_whole_budget():
    s = make(max_num_batched_tokens=16, background_prefill_tokens=4)
    a, b = background(req("a", 10)), background(req("b", 10))
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert out.plan == [("a", 0, 10, True), ("b", 0, 6, False)]
    run_all(s)
    assert_empty(s)


def test_the_small_share_lingers_after_the_last_interactive_request(monkeypatch):
    from kvserve.scheduler import scheduler as scheduler_module

    clock = [100.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: clock[0])
    s = make(max_num_batched_tokens=16, background_prefill_tokens=4)
    user = req("user", 3, max_tokens=1)
    s.add_request(user)
    run_all(s)  # the user came and went at t=100
    line = background(req("line", 40))
    s.add_request(line)
    out, _ = step(s)
    assert out.plan == [("line", 0, 4, False)]  # its next request may come any moment
    clock[0] += scheduler_module.INTERACTIVE_LINGER_S
    out, _ = step(s)
    assert out.plan == [("line", 4, 16, False)]  # long gone: the whole budget
