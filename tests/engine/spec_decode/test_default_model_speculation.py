"""The default model (SmolLM2-135M-Instruct, float32) with speculative decoding: 32
chat prompts in mixed batches, greedy, token-identical to plain decoding with each
proposer (n-gram, early exit, a draft model), and drafts really accepted."""
from __future__ import annotations

import pytest

from kvserve.engine.config.engine_config import EngineConfig, SpeculativeConfig
from kvserve.engine.core.engine import Engine
from kvserve.scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
TEXTS = ["the quick brown fox jumps over the lazy dog", "one two three four five six",
         "Paged attention stores keys and values in blocks", "def add(a, b): return a + b"]
ASKS = ["Repeat this exactly: {}", "Say this twice: {}", "Write a sentence about: {}",
        "Translate to French: {}", "Count the words in: {}", "Make this shorter: {}",
        "Continue the list: {}", "Explain: {}"]


def chat_prompts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    prompts = []
    for ask in ASKS:
        for text in TEXTS:
            rendered = tok.apply_chat_template([{"role": "user", "content": ask.format(text)}],
                                               tokenize=False, add_generation_prompt=True)
            prompts.append(tok(rendered, add_special_tokens=False)["input_ids"])
    return prompts


@pytest.mark.slow
def test_default_model_greedy_identical_with_each_proposer(default_model_dir):
    def engine(spec):
        return Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                   kv_cache_memory=256 << 20, max_num_seqs=32,
                                   max_num_batched_tokens=512, speculative=spec))

    plain = engine(None)
    prompts = chat_prompts(plain)
    assert len(prompts) == 32
    want = plain.generate(prompts, GREEDY)
    del plain
    for spec in (SpeculativeConfig("ngram", num_tokens=4, disable_batch_size=0),
                 SpeculativeConfig("early-exit", num_tokens=2, draft_layers=8,
                                   disable_batch_size=0),
                 # No smaller model shares its vocabulary here: the model drafts for
                 # itself, which exercises the draft-model path (its own cache).
                 SpeculativeConfig("draft", num_tokens=2, disable_batch_size=0,
                                   model=str(default_model_dir))):
        e = engine(spec)
        assert e.generate(prompts, GREEDY) == want, spec.method
        assert e.speculator.stats.num_accepted_tokens > 0, spec.method
        assert e.scheduler.kv.num_free_blocks == e.scheduler.kv.num_blocks
