"""Our forward pass through the engine against transformers, same weights, float32:
greedy continuations token-identical, first-step logits within 1e-4."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import (load_reference, reference_greedy, reference_logits,
                                     varied_prompts)

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
ARCHS = ["llama", "llama3rope", "mistral", "qwen2", "qwen3"]


def first_step_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """Logits of the prompt's last token, computed by the engine's runner."""
    from kvserve.scheduler.output import ScheduledRequest
    from kvserve.scheduler.request import Request

    req = Request("logits-probe", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    assert engine.scheduler.kv.allocate_slots(req.request_id, prompt, 0, len(prompt))
    try:
        item = ScheduledRequest(req, len(prompt), engine.scheduler.kv.block_table(req.request_id))
        with torch.inference_mode():
            return engine.runner.forward_logits(engine.runner.prepare([item]))[0]
    finally:
        engine.scheduler.kv.free(req.request_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_greedy_matches_transformers(arch, tiny_engine_factory, tiny_model_dir):
    engine = tiny_engine_factory(arch)
    ref = load_reference(tiny_model_dir(arch))
    prompts = varied_prompts(engine.model_config.vocab_size)
    ours = engine.generate(prompts, GREEDY_64)  # all 16 at once: mixed batches
    for prompt, got in zip(prompts, ours):
        assert got == reference_greedy(ref, prompt, 64), f"prompt of {len(prompt)} tokens"
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_first_step_logits(arch, tiny_engine_factory, tiny_model_dir):
    engine = tiny_engine_factory(arch)
    ref = load_reference(tiny_model_dir(arch))
    for prompt in varied_prompts(engine.model_config.vocab_size, count=4, seed=1):
        ours = first_step_logits(engine, prompt).cpu()  # the reference runs on the CPU
        diff = (ours - reference_logits(ref, prompt)).abs().max()
        assert diff < 1e-4


def test_chunked_prefill_and_small_budget_give_same_tokens(tiny_engine_factory):
    prompts = varied_prompts(400, count=6, seed=2, lengths=(300, 129, 64, 31, 5, 200))
    whole = tiny_engine_factory("llama", max_num_batched_tokens=2048).generate(prompts, GREEDY_64)
    chunked = tiny_engine_factory("llama", max_num_batched_tokens=37).generate(prompts, GREEDY_64)
    assert chunked == whole


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_model_dir):
    engine = Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                 max_num_batched_tokens=512))
    ref = load_reference(default_model_dir)
    # Six lengths across block boundaries (the tiny models' tests take all sixteen):
    # this test's reference generation was the suite's slowest, 76 s.
    prompts = varied_prompts(engine.model_config.vocab_size, count=6, seed=3,
                             lengths=(1, 17, 33, 64, 129, 300))
    ours = engine.generate(prompts, GREEDY_64)
    for prompt, got in zip(prompts, ours):
        assert got == reference_greedy(ref, prompt, 64), f"prompt of {len(prompt)} tokens"
    for prompt in prompts[:4]:
        ours = first_step_logits(engine, prompt).cpu()  # the reference runs on the CPU
        diff = (ours - reference_logits(ref, prompt)).abs().max()
        assert diff < 1e-4
