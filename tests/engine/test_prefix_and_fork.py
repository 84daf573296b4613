"""The paged cache in the real engine: prefix hits skip prefill without changing
outputs, and n > 1 shares the prompt through fork + copy-on-write."""
from __future__ import annotations

import math

from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import varied_prompts


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_shared_prefix_computes_only_the_tail(tiny_engine_factory):
    prefix = varied_prompts(400, 1, seed=20, lengths=(256,))[0]
    tails = varied_prompts(400, 2, seed=21, lengths=(9, 23))
    first, second = prefix + tails[0], prefix + tails[1]

    cached = tiny_engine_factory()
    out_first = cached.generate([first], greedy(32))[0]
    computed_before = cached.stats().prompt_tokens_computed
    out_second = cached.generate([second], greedy(32))[0]  # its owner has finished
    second_computed = cached.stats().prompt_tokens_computed - computed_before
    assert second_computed == len(tails[1])  # 256 = 16 full blocks hit
    assert cached.scheduler.kv.stats.prefix_hits == 256

    plain = tiny_engine_factory(enable_prefix_caching=False)
    assert plain.generate([first], greedy(32))[0] == out_first
    assert plain.generate([second], greedy(32))[0] == out_second
    assert plain.stats().prompt_tokens_computed == len(first) + len(second)


def test_prefix_hit_keeps_the_last_prompt_token_computed(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompt = varied_prompts(400, 1, seed=22, lengths=(64,))[0]  # exactly 4 blocks
    once = engine.generate([prompt], greedy(8))[0]
    before = engine.stats().prompt_tokens_computed
    assert engine.generate([prompt], greedy(8))[0] == once
    # 3 blocks hit; the 4th is recomputed because its last token's logits are needed
    assert engine.stats().prompt_tokens_computed - before == 16


def test_n4_stores_the_prompt_once_and_cow_keeps_sequences_apart(tiny_engine_factory):
    engine = tiny_engine_factory()
    bs = engine.scheduler.kv.block_size
    prompt = varied_prompts(400, 1, seed=23, lengths=(100,))[0]  # last block partial
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, n=4, ignore_eos=True)
    engine.add_request("group", prompt, params)
    engine.step()  # prompt computed once, then forked
    prompt_blocks = math.ceil(len(prompt) / bs)
    assert engine.scheduler.kv.num_blocks - engine.scheduler.kv.num_free_blocks == prompt_blocks
    assert len(engine.scheduler.running) == 4
    # The next step: all four write position 100 into the shared partial block.
    schedule, planned = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: planned.append(out := schedule()) or out
    engine.step()
    engine.scheduler.schedule = schedule
    assert len(planned[0].block_copies) == 3  # 3 of the 4 writers get a private copy
    assert engine.scheduler.kv.num_blocks - engine.scheduler.kv.num_free_blocks == prompt_blocks + 3

    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs.setdefault(o.index, []).extend(o.new_token_ids)
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    # Each sequence (tokens 3.. of it, the first two were taken above) equals the
    # same seeded request run alone: no sequence saw another's keys and values.
    fresh = tiny_engine_factory()
    for i in range(4):
        alone = SamplingParams(max_tokens=24, temperature=1.0, seed=5 + i, ignore_eos=True)
        assert fresh.generate([prompt], alone)[0][2:] == outputs[i], f"sequence {i}"
    assert len({tuple(v) for v in outputs.values()}) == 4


def test_abort_before_fork_ends_all_siblings(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_batched_tokens=16)
    prompt = varied_prompts(400, 1, seed=24, lengths=(80,))[0]
    engine.add_request("g", prompt, SamplingParams(max_tokens=8, n=3, ignore_eos=True))
    engine.step()  # mid-prompt: siblings not forked yet
    outs = engine.abort_request("g")
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert all(o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
