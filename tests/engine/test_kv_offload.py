"""The second KV tier (engine/kv_offload/): a conversation whose history the KV cache
evicted gets it back from host memory or disk, as cached tokens, with output equal
to computing it again; a corrupt or torn disk block is computed again, never served."""
from __future__ import annotations

import pytest

from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import varied_prompts

BLOCKS = 40  # 640 tokens of cache: three 220-token fillers evict the history
# The history's blocks the first turn fills: its 150 prompt tokens and 15 of its 16
# generated ones (the last has no KV yet), 10 full blocks.
HISTORY_HITS = 10 * 16


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def conversation(seed: int):
    """A first turn, fillers that push it out of the cache, and the second turn."""
    history, *fillers = varied_prompts(400, 4, seed=seed, lengths=(150, 220, 230, 210))
    return history, fillers


def two_turns(engine, history, fillers, extra):
    """(second turn's output, its hit tokens, its computed prompt tokens)."""
    first = engine.generate([history], greedy(16))[0]
    for filler in fillers:
        engine.generate([filler], greedy(4))
    second = history + first + extra
    kv = engine.scheduler.kv
    hits, computed = kv.stats.prefix_hits, engine.stats().prompt_tokens_computed
    out = engine.generate([second], greedy(16))[0]
    return (out, kv.stats.prefix_hits - hits,
            engine.stats().prompt_tokens_computed - computed, len(second))


def assert_no_block_held(engine):
    kv = engine.scheduler.kv
    assert not engine.scheduler.has_unfinished()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("arch,options", [("llama", {}), ("deepseekv3", {}),
                                          ("llama", {"kv_cache_dtype": "fp8"})],
                         ids=["llama", "latent", "fp8"])
def test_an_evicted_history_comes_back_from_host_memory(tiny_engine_factory, arch, options):
    history, fillers = conversation(31)
    extra = varied_prompts(400, 1, seed=32, lengths=(12,))[0]
    plain = tiny_engine_factory(arch, num_kv_blocks=BLOCKS, **options)
    want, plain_hits, plain_computed, n = two_turns(plain, history, fillers, extra)
    assert plain_hits == 0 and plain_computed == n  # evicted: all of it again

    tiered = tiny_engine_factory(arch, num_kv_blocks=BLOCKS, kv_offload_bytes=64 << 20,
                                 **options)
    got, hits, computed, n = two_turns(tiered, history, fillers, extra)
    assert got == want
    # The history's full blocks come back; the rest is computed.
    assert hits == HISTORY_HITS and computed == n - hits
    tier = tiered.runner.kv_tier
    assert tier.stats.saved > 0 and tier.stats.loaded == HISTORY_HITS // 16
    assert tiered.scheduler.kv.stats.tier_hits == hits
    assert_no_block_held(tiered)


@pytest.mark.parametrize("compile", ["off", "wait"])
def test_many_requests_through_preemption_and_chunks_equal_a_recompute(tiny_engine_factory,
                                                                       compile):
    prompts = varied_prompts(400, 6, seed=33, lengths=(150, 170, 90, 210, 130, 60))
    shared = varied_prompts(400, 1, seed=34, lengths=(96,))[0]
    prompts = [shared + p for p in prompts]
    params = greedy(40)
    want = tiny_engine_factory(enable_prefix_caching=False).generate(prompts, params)
    tiered = tiny_engine_factory(num_kv_blocks=BLOCKS, kv_offload_bytes=64 << 20,
                                 max_num_batched_tokens=64, compile=compile)
    for _ in range(2):  # the second round finds what the first round's evictions kept
        assert tiered.generate(prompts, params) == want
    assert tiered.stats().num_preemptions > 0
    assert tiered.runner.kv_tier.stats.loaded > 0
    assert_no_block_held(tiered)


def history_hashes(engine, tokens):
    from kvserve.kvcache.block_hash import BlockHasher, root_hash

    parent, hasher, out = root_hash(str(engine.config.model), None), BlockHasher(16), []
    for start in range(0, len(tokens) // 16 * 16, 16):
        parent = hasher.hash_block(parent, tokens[start:start + 16])
        out.append(parent)
    return out


def test_blocks_spill_to_disk_and_a_corrupt_one_is_computed_again(tiny_engine_factory,
                                                                  tmp_path):
    history, fillers = conversation(35)
    extra = varied_prompts(400, 1, seed=36, lengths=(12,))[0]
    want = two_turns(tiny_engine_factory(num_kv_blocks=BLOCKS), history, fillers, extra)[0]
    probe = tiny_engine_factory(num_kv_blocks=BLOCKS, kv_offload_bytes=64 << 20)
    block_bytes = probe.runner.kv_tier.block_bytes
    del probe

    def tiered():  # two blocks in host memory: the rest goes to disk
        return tiny_engine_factory(num_kv_blocks=BLOCKS, kv_offload_bytes=2 * block_bytes,
                                   kv_offload_dir=str(tmp_path / "kv"))

    engine = tiered()
    got, hits, _, _ = two_turns(engine, history, fillers, extra)
    tier = engine.runner.kv_tier
    assert got == want and hits == HISTORY_HITS
    assert tier.stats.spilled > 0 and tier.stats.from_disk >= HISTORY_HITS // 16 - 2
    assert_no_block_held(engine)
    second = history + engine.generate([history], greedy(16))[0] + extra
    del engine

    # A restart finds the history on disk: the first request hits it.
    engine = tiered()
    disk = engine.runner.kv_tier.disk
    blocks = history_hashes(engine, history)
    assert all(h in disk for h in blocks)
    assert engine.generate([second], greedy(16))[0] == want
    assert engine.scheduler.kv.stats.prefix_hits == HISTORY_HITS
    del engine

    # The history's third block gets a flipped byte, its fifth is torn in half: the
    # chain stops at the third, which is dropped and computed again.
    engine = tiered()
    disk = engine.runner.kv_tier.disk
    flipped, torn = disk._path(blocks[2]), disk._path(blocks[4])
    data = bytearray(flipped.read_bytes())
    data[-7] ^= 0x40
    flipped.write_bytes(bytes(data))
    torn.write_bytes(torn.read_bytes()[:1000])
    assert engine.generate([second], greedy(16))[0] == want
    assert disk.corrupt == 1 and not flipped.exists()
    assert engine.scheduler.kv.stats.prefix_hits == 2 * 16
    assert_no_block_held(engine)
    # The torn one is found when something reads it.
    assert not engine.runner.kv_tier.find(blocks[4]) and disk.corrupt == 2


def test_flags_that_cannot_work_together_are_refused(tiny_engine_factory, tmp_path):
    from kvserve.modelstore.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="needs --kv-offload-bytes"):
        tiny_engine_factory(kv_offload_dir=str(tmp_path))
    with pytest.raises(ModelLoadError, match="prefix caching off"):
        tiny_engine_factory(kv_offload_bytes=1 << 30, enable_prefix_caching=False)
    with pytest.raises(ModelLoadError, match="holds no block"):
        tiny_engine_factory(kv_offload_bytes=1000)
