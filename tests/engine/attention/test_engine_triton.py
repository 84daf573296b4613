"""End to end on the tiny random models: every step's logits through the Triton
backend (interpreted on CPU) match the torch backend's, and so do the tokens, for
plain prefill, chunked prefill with odd chunk sizes, prefix-cache hits, decoding
and a mixed batch of 8 requests. The tiny models have 6 query heads over 2 kv
heads (GQA 3) and head dims 16 (llama) and 24 (qwen3): tiles padded to 16 and 32."""
from __future__ import annotations

import torch

from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.attention.paged_batch import DEVICE, needs_kernel_device
from tests.support.reference import varied_prompts

pytestmark = needs_kernel_device

VOCAB = 300  # below the tiny tokenizer's vocabulary


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    return varied_prompts(VOCAB, count=len(lengths), seed=seed, lengths=lengths)


def record_logits(engine) -> list[torch.Tensor]:
    """Every step's logits, as the runner computes them."""
    steps = []
    forward_logits = engine.runner.forward_logits

    def recording(batch):
        logits = forward_logits(batch)
        steps.append(logits.clone())
        return logits

    engine.runner.forward_logits = recording
    return steps


def run(factory, backend: str, arch: str, waves, params, **config):
    # Eager: on CUDA, decode steps would otherwise replay graphs past forward_logits,
    # and the two backends' recorded steps would not line up.
    engine = factory(arch, attention_backend=backend, device=DEVICE, dtype="float32",
                     enforce_eager=True, **config)
    steps = record_logits(engine)
    tokens = [engine.generate(wave, params) for wave in waves]
    return tokens, steps, engine


def assert_same_run(factory, arch, waves, params, **config):
    """Returns the triton engine, for scenario-specific checks."""
    want, want_steps, _ = run(factory, "torch", arch, waves, params, **config)
    got, got_steps, engine = run(factory, "triton", arch, waves, params, **config)
    assert engine.runner.attn_backend.name == "triton"
    assert len(got_steps) == len(want_steps)
    for i, (g, w) in enumerate(zip(got_steps, want_steps)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {i}: {m}")
    assert got == want
    return engine


def test_plain_prefill(tiny_engine_factory):
    assert_same_run(tiny_engine_factory, "llama", [prompts(200, 31)], greedy(2))


def test_chunked_prefill_with_odd_chunks(tiny_engine_factory):
    assert_same_run(tiny_engine_factory, "llama", [prompts(150, 61, 5, seed=1)], greedy(3),
                    max_num_batched_tokens=37)


def test_prefix_hits(tiny_engine_factory):
    first = prompts(80, seed=2)[0]
    # The second wave shares 64 and 70 tokens with the first prompt (4 full blocks
    # of 16 either way), so both start mid-context.
    second = [first[:64] + prompts(30, seed=3)[0], first[:70] + prompts(9, seed=4)[0]]
    engine = assert_same_run(tiny_engine_factory, "qwen3", [[first], second], greedy(4))
    computed = engine.stats().prompt_tokens_computed
    assert computed == 80 + (94 - 64) + (79 - 64), "the prefix cache was not hit"


def test_decode(tiny_engine_factory):
    assert_same_run(tiny_engine_factory, "qwen3", [prompts(30, seed=5)], greedy(24))


def test_mixed_batch_of_eight(tiny_engine_factory):
    wave = prompts(3, 250, 17, 64, 1, 120, 33, 90, seed=6)
    assert_same_run(tiny_engine_factory, "llama", [wave], greedy(5), max_num_batched_tokens=64)
