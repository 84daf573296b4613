"""Scheduling proofs on the real engine (tiny model, CPU, float32 greedy)."""
from __future__ import annotations

from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import varied_prompts


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_alone(factory, prompt, params) -> list[int]:
    return factory().generate([prompt], params)[0]


def test_long_prefill_is_chunked_beside_running_decodes(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_batched_tokens=256, enable_prefix_caching=False)
    short = varied_prompts(400, count=8, seed=30, lengths=(5, 9, 14, 20, 26, 33, 41, 50))
    long_prompt = varied_prompts(400, 1, seed=31, lengths=(3000,))[0]
    for i, p in enumerate(short):
        engine.add_request(f"s{i}", p, greedy(40))
    outputs: dict[str, list[int]] = {}
    for o in engine.step():  # the 8 short prompts fit one step; from now on they decode
        outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.add_request("long", long_prompt, greedy(8))
    chunked_steps = 0
    while engine.has_unfinished_requests():
        planned = engine.scheduler.schedule
        schedule = []
        engine.scheduler.schedule = lambda: schedule.append(o := planned()) or o
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.scheduler.schedule = planned
        step = {s.request.request_id: s.num_new_tokens for s in schedule[0].scheduled}
        if "long" in step and step["long"] > 1:  # a prefill chunk rides along
            chunked_steps += 1
            assert step["long"] < len(long_prompt)
            running_short = [f"s{i}" for i in range(8) if len(outputs.get(f"s{i}", [])) < 40]
            assert all(step.get(r) == 1 for r in running_short), step
            assert sum(step.values()) <= 256
    assert chunked_steps >= 3000 // 256
    for i, p in enumerate(short):
        assert outputs[f"s{i}"] == run_alone(tiny_engine_factory, p, greedy(40))
    assert outputs["long"] == run_alone(tiny_engine_factory, long_prompt, greedy(8))


def test_tiny_kv_cache_preempts_32_requests_and_outputs_match(tiny_engine_factory):
    prompts = varied_prompts(400, count=32, seed=32, lengths=(12, 40, 77, 100, 5, 63))
    params = [greedy(16 + (i * 7) % 40) for i in range(32)]
    tight = tiny_engine_factory(num_kv_blocks=40, max_num_seqs=32)  # 640 token slots
    together = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.kv.num_free_blocks == tight.scheduler.kv.num_blocks
    roomy = tiny_engine_factory()
    for p, sp, got in zip(prompts, params, together):
        assert got == roomy.generate([p], sp)[0]


def test_priority_policy_admits_urgent_requests_first(tiny_engine_factory):
    engine = tiny_engine_factory(scheduling_policy="priority", max_num_seqs=1)
    prompts = varied_prompts(400, count=3, seed=33, lengths=(10,))
    engine.add_request("low", prompts[0], greedy(3), priority=5)
    engine.add_request("urgent", prompts[1], greedy(3), priority=-1)
    engine.add_request("normal", prompts[2], greedy(3), priority=0)
    order = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                order.append(o.request_id)
    assert order == ["urgent", "normal", "low"]
