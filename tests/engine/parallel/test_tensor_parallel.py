"""Tensor parallelism on CPU (gloo): greedy output token-identical to one rank in
float32, through chunked prefill, prefix-cache hits and copy-on-write forks.

The engines are pinned to the CPU: on a machine with one GPU, device "auto" would
put rank 1 on cuda:1, which does not exist; it would die, and the group's watcher
would end the process it watches from, pytest itself (os._exit). A rank that dies
anyway fails its test instead."""
from __future__ import annotations

import contextlib

import pytest

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.ranks import step_channel
from kvserve.scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def tp_config(model_dir, tp: int, **overrides) -> EngineConfig:
    cfg = dict(model=str(model_dir), dtype="float32", compile="off", num_kv_blocks=256,
               max_num_batched_tokens=64, tensor_parallel_size=tp, device="cpu")
    cfg.update(overrides)
    return EngineConfig(**cfg)


@contextlib.contextmanager
def engine(model_dir, tp: int, **overrides):
    e = Engine(tp_config(model_dir, tp, **overrides))
    deaths: list[str] = []
    e.on_rank_death(deaths.append)  # not os._exit: the test fails, pytest goes on
    try:
        yield e
    finally:
        e.close()
    assert not deaths, deaths


def test_ranks_stay_on_the_cpu_beside_a_gpu(tiny_model_dir, monkeypatch):
    from kvserve.engine.platform.device import resolve_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert resolve_device(EngineConfig(model="m").device).type == "cuda"  # (the fake)
    assert resolve_device(tp_config(tiny_model_dir("llama"), 2).device).type == "cpu"


def prompts(vocab: int) -> list[list[int]]:
    """16 prompts: eight pairs sharing a 20-token prefix (prefix hits once the first of
    a pair is cached), several longer than one step's budget (chunked prefill)."""
    out = []
    for pair in range(8):
        shared = [(pair * 31 + j * 7) % (vocab - 1) + 1 for j in range(20)]
        for k in range(2):
            tail = [(pair * 13 + k * 17 + j * 3) % (vocab - 1) + 1 for j in range(5 + 9 * pair)]
            out.append(shared + tail)
    return out


def run(e: Engine, batch: list[list[int]]) -> tuple[list[list[int]], int]:
    """(greedy tokens, prefix-cache hits), all 16 at once: the first of each pair
    ahead of the seconds, whose shared prefix is cached by the time they are
    admitted (the budget admits a few prompts a step); then a fork (n=2), whose
    shared last block is copied on write."""
    order = batch[0::2] + batch[1::2]
    tokens = e.generate(order, GREEDY)
    forked = e.generate(batch[:1], SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True, n=2))
    return tokens + forked, e.scheduler.stats().prefix_hits


def assert_same_as_one_rank(model_dir, tp: int, vocab: int, **overrides) -> int:
    """Returns the generation its step channel's segment reached. overrides: the
    tensor-parallel engine's other settings."""
    batch = prompts(vocab)
    assert max(map(len, batch)) > 64  # chunked
    with engine(model_dir, 1) as e:
        want, hits_one = run(e, batch)
    with engine(model_dir, tp, **overrides) as e:
        got, hits = run(e, batch)
        generation = e.runner.step_channel.generation
    assert hits > 0 and hits == hits_one
    for i, (a, b) in enumerate(zip(want, got)):
        assert a == b, f"sequence {i} differs"
    return generation


def test_two_ranks_match_one_rank_tiny(tiny_model_dir, monkeypatch):
    # A tiny step channel: the metadata outgrows it and moves to larger segments.
    monkeypatch.setattr(step_channel, "_INITIAL_CAPACITY", 64)
    copies: list[int] = []  # copy-on-write copies each step carried to rank 1
    send = step_channel.StepChannel.send

    def counting_send(self, *args):
        copies.append(len(self.pending_copies))
        return send(self, *args)

    monkeypatch.setattr(step_channel.StepChannel, "send", counting_send)
    model_dir = tiny_model_dir("llama")  # 6 heads, 2 KV heads: one KV head per rank
    assert assert_same_as_one_rank(model_dir, 2, vocab=300) > 0  # the segment grew
    assert sum(copies) > 0  # the fork's shared last block was copied on write


def test_two_ranks_sharing_one_kv_head_match_one_rank(tmp_path):
    from tests.support.tiny_models import make_tiny_model

    # 4 query heads, 1 KV head: both ranks hold (a copy of) the one KV head.
    model_dir = make_tiny_model(tmp_path / "one-kv-head", "llama", num_attention_heads=4,
                                num_key_value_heads=1, hidden_size=64)
    assert_same_as_one_rank(model_dir, 2, vocab=300)


@pytest.mark.slow
def test_three_ranks_match_one_rank_default_model(default_model_dir):
    # SmolLM2-135M: 9 query heads, 3 KV heads, tied embeddings, 49152-token vocabulary.
    assert_same_as_one_rank(default_model_dir, 3, vocab=49152)


def test_unsplittable_and_unsupported_are_refused(tiny_model_dir):
    from kvserve.modelstore.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="does not divide the model's 6 attention"):
        Engine(tp_config(tiny_model_dir("llama"), 4))
    with pytest.raises(ModelLoadError, match="weight quantization"):
        Engine(tp_config(tiny_model_dir("llama"), 2, quantization="int8"))
