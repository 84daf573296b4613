"""The runner against a fake server: bodies, concurrency cap, conversations, failures."""
from __future__ import annotations

import asyncio

import pytest

from kvserve.benchmarks.client.client import Target
from kvserve.benchmarks.client.datasets import DatasetSpec, make_sessions
from kvserve.benchmarks.client.runner import SKIPPED, Run, Traffic
from tests.bench.client.fake_server import FakeServer


def run(server: FakeServer, target: Target, spec: DatasetSpec, traffic=Traffic()):
    async def go():
        async with server.client() as http:
            r = Run(http, target, traffic)
            duration = await r.all(make_sessions(spec))
            return r.records, duration
    return asyncio.run(go())


def test_bodies_ask_for_a_fixed_length_stream_with_usage():
    server = FakeServer()
    target = Target("/v1/completions", "m", {"temperature": 0.0})
    spec = DatasetSpec("random", num_prompts=3, input_len=4, output_len=5, token_ids=True)
    records, _ = run(server, target, spec)
    assert [r.success for r in records] == [True] * 3
    body = server.bodies[0]
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m" and body["temperature"] == 0.0 and len(body["prompt"]) == 4
    assert all(r.output_tokens == 5 and len(r.itls()) == 4 for r in records)


def test_max_concurrency_caps_requests_in_flight():
    server = FakeServer(delay=0.02)
    spec = DatasetSpec("random", num_prompts=12, input_len=2, output_len=2)
    records, _ = run(server, Target("/v1/completions", "m"), spec, Traffic(max_concurrency=3))
    assert len(records) == 12 and server.most_in_flight == 3


def test_request_rate_spreads_the_sends():
    server = FakeServer()
    spec = DatasetSpec("random", num_prompts=6, input_len=2, output_len=2)
    _, paced = run(server, Target("/v1/completions", "m"), spec, Traffic(request_rate=50))
    # Five seeded gaps of ~20 ms on average: sleeping never makes them shorter, so a
    # lower bound holds however busy the machine is (comparing with an unpaced run
    # did not: a slow first run made it flaky).
    assert paced > 0.04


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_conversation_turns_carry_the_previous_answer(endpoint):
    server = FakeServer()
    spec = DatasetSpec("conversation", num_prompts=2, input_len=3, output_len=2, turns=3)
    records, _ = run(server, Target(endpoint, "m"), spec)
    assert len(records) == 6 and all(r.success for r in records)
    chat = endpoint.endswith("chat/completions")
    by_session = {}
    for body in server.bodies:
        # a session's first message (three words) opens every prompt of the session
        first = (body["messages"][0]["content"] if chat
                 else " ".join(body["prompt"].split()[:3]))
        by_session.setdefault(first, []).append(body["messages"] if chat else body["prompt"])
    assert sorted(len(v) for v in by_session.values()) == [3, 3]
    for prompts in by_session.values():
        for prev, cur in zip(prompts, prompts[1:]):
            assert cur[:len(prev)] == prev and len(cur) > len(prev)
            answer = cur[len(prev)]["content"] if chat else cur[len(prev):]
            assert " a" in answer  # the fake server's text for the previous turn


def test_a_failed_turn_skips_the_rest_of_its_session():
    server = FakeServer(fail_when=lambda body: "messages" in body and len(body["messages"]) > 1)
    spec = DatasetSpec("conversation", num_prompts=2, input_len=3, output_len=2, turns=3)
    records, _ = run(server, Target("/v1/chat/completions", "m"), spec)
    assert len(records) == 6 and sum(r.success for r in records) == 2
    errors = sorted(r.error for r in records if not r.success)
    assert errors[:2] == ['HTTP 500: {"error":{"message":"boom"}}'] * 2
    assert errors[2:] == [SKIPPED] * 2 and len(server.bodies) == 4
