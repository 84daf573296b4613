"""A request that wants prompt logprobs needs the logits of every prompt position, so
the scheduler gives it no prefix-cache hit (as vLLM does) until its first token is
out; it still registers its blocks for others."""
from __future__ import annotations

from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from tests.scheduler.test_scheduler_unit import assert_empty, make, run_all, step

PROMPT = list(range(500, 509))  # two full blocks of 4 and one token


def prompt_request(rid: str, prompt=PROMPT, salt=None, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4, **params), (),
                   cache_salt=salt)


def test_prompt_logprobs_request_takes_no_hit_but_registers_its_blocks():
    s = make()
    s.add_request(prompt_request("warm"))
    run_all(s)
    b = prompt_request("b", prompt_logprobs=1)
    assert b.needs_prompt_logits
    s.add_request(b)
    out, _ = step(s)
    assert out.plan == [("b", 0, 9, True)] and b.num_cached_tokens == 0
    assert not b.needs_prompt_logits  # its first token is out
    run_all(s)
    other = list(range(700, 709))
    s.add_request(prompt_request("c", other, salt="t", prompt_logprobs=0))
    run_all(s)
    d = prompt_request("d", other, salt="t")
    s.add_request(d)
    out, _ = step(s)
    assert out.plan == [("d", 8, 1, True)] and d.num_cached_tokens == 8
    run_all(s)
    assert_empty(s)


def test_after_its_first_token_a_preempted_request_may_hit_again():
    s = make(num_blocks=5, max_num_batched_tokens=64)
    a, b = prompt_request("a", list(range(4))), prompt_request("b", list(range(10, 14)))
    c = prompt_request("c", list(range(20, 26)), prompt_logprobs=2)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # c computes its prompt (no hit) and samples its first token
    out, _ = step(s)
    assert out.preempted == ["c"]
    while "c" not in [x.request.request_id for x in out.scheduled]:
        out, _ = step(s)
    assert next(p[1] for p in out.plan if p[0] == "c") == 4  # its prompt block is a hit
    run_all(s)
    assert_empty(s)
