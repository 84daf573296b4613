"""Engine behaviour on a tiny model: continuous batching, preemption, abort, sampling."""
from __future__ import annotations

import pytest

from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import varied_prompts


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_concurrent_requests_equal_running_alone(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompts = varied_prompts(400, count=16, seed=4)
    params = [greedy(4 + 7 * i) for i in range(16)]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert together == alone
    assert [len(t) for t in together] == [sp.max_tokens for sp in params]


def test_requests_join_and_leave_between_steps(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompts = varied_prompts(400, count=3, seed=5)
    engine.add_request("a", prompts[0], greedy(30))
    for _ in range(5):
        engine.step()
    engine.add_request("b", prompts[1], greedy(3))  # joins a running batch
    seen = set()
    while engine.has_unfinished_requests():
        seen.update(o.request_id for o in engine.step())
    assert seen == {"a", "b"}
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_tiny_kv_cache_preempts_and_still_matches(tiny_engine_factory):
    prompts = varied_prompts(400, count=12, seed=6, lengths=(40, 70, 33, 90))
    params = greedy(48)
    roomy = tiny_engine_factory().generate(prompts, params)
    tight = tiny_engine_factory(num_kv_blocks=24)  # 384 tokens for 12 requests of ~110
    assert tight.generate(prompts, params) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.kv.num_free_blocks == tight.scheduler.kv.num_blocks


@pytest.mark.parametrize("steps_before_abort", [0, 1, 6])
def test_abort_frees_every_block(tiny_engine_factory, steps_before_abort):
    engine = tiny_engine_factory(max_num_batched_tokens=16)  # a prompt spans several steps
    engine.add_request("victim", varied_prompts(400, 1, seed=7, lengths=(100,))[0], greedy(50))
    engine.add_request("other", varied_prompts(400, 1, seed=8, lengths=(20,))[0], greedy(5))
    for _ in range(steps_before_abort):
        engine.step()
    (out,) = engine.abort_request("victim")
    assert out.finished and out.finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    assert engine.abort_request("victim") == []  # unknown now: a no-op


def test_eos_and_stop_tokens_finish_with_reason(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompt = varied_prompts(400, 1, seed=9)[0]
    free_run = engine.generate([prompt], greedy(20))[0]
    stop_at = free_run[5]
    params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at])
    engine.add_request("s", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    last = outs[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop_at
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == free_run[:free_run.index(stop_at) + 1]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompts = varied_prompts(400, count=5, seed=10)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate([prompts[0]], seeded)[0]
    noisy = SamplingParams(max_tokens=24, temperature=1.0)
    batch = engine.generate(prompts, [seeded] + [noisy] * 4)[0]
    assert alone == batch == engine.generate([prompts[0]], seeded)[0]
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=99)
    assert engine.generate([prompts[0]], other_seed)[0] != alone


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    ([5] * 5000, "maximum context length"),
    ([1, 2, 10**6], "out of the vocabulary"),
])
def test_requests_that_can_never_run_are_rejected(tiny_engine_factory, prompt, message):
    engine = tiny_engine_factory(max_model_len=4096)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, greedy(4))
    assert not engine.has_unfinished_requests()
