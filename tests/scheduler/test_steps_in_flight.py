"""The scheduler under pipeline stages (SchedulerConfig.steps_in_flight = P): a
request whose sampled token is still on its way sits the next steps out, each step
seats at most 1/P of the requests, and the steps in flight split the requests
between them; their results come back in launch order (no model: the fake runner
of tests/scheduler/sim.py gives the tokens)."""
from __future__ import annotations

from collections import deque

from tests.scheduler.sim import expected_tokens, sample_for
from tests.scheduler.test_scheduler_unit import make, req


def test_steps_in_flight_take_disjoint_requests_and_finish_as_alone():
    s = make(steps_in_flight=2, max_num_batched_tokens=64)
    reqs = [req(f"r{i}", 6, max_tokens=5) for i in range(6)]
    for r in reqs:
        s.add_request(r)
    in_flight: deque = deque()
    seen: list[set[str]] = []
    while s.has_unfinished() or in_flight:
        if len(in_flight) < 2:
            out = s.schedule()
            if not out.is_empty:
                ids = {x.request.request_id for x in out.scheduled}
                assert len(ids) <= 3  # half of the six at most
                for other in in_flight:  # none is in another step in flight
                    assert not ids & {x.request.request_id for x in other.scheduled}
                seen.append(ids)
                in_flight.append(out)
                if len(in_flight) < 2:
                    continue
        s.update(in_flight[0], sample_for(in_flight[0]))
        in_flight.popleft()
    assert all(len(ids) == 3 for ids in seen[:2])  # both steps in flight had work
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r.request_id, 6, 5)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_one_step_at_a_time_keeps_every_request_in_each_step():
    s = make(max_num_batched_tokens=64)
    for i in range(6):
        s.add_request(req(f"r{i}", 6))
    assert len(s.schedule().scheduled) == 6
