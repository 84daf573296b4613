"""Penalties, logit_bias and min_tokens in the real engine: greedy rows follow the
processed logits (checked step by step against transformers plus the formulas), a
request's tokens do not depend on its batch, and EOS/stop tokens wait for min_tokens."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import load_reference, varied_prompts

PENALIZED = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                           repetition_penalty=1.4, frequency_penalty=0.6,
                           presence_penalty=0.4, logit_bias={7: 2.5, 9: -4.0})


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding with logit_bias then the penalties applied by hand."""
    ids = list(prompt)
    for _ in range(p.max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        for t, b in (p.logit_bias or {}).items():
            logits[t] += b
        for t in set(ids):
            x = logits[t].item()
            logits[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t, c in Counter(ids[len(prompt):]).items():
            logits[t] -= p.frequency_penalty * c + p.presence_penalty
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_greedy_with_penalties_and_bias_matches_reference(tiny_engine_factory, tiny_model_dir):
    engine = tiny_engine_factory()
    ref = load_reference(tiny_model_dir("llama"))
    prompts = varied_prompts(400, count=2, seed=40, lengths=(5, 30))
    ours = engine.generate(prompts, PENALIZED)
    for prompt, got in zip(prompts, ours):
        assert got == reference_greedy(ref, prompt, PENALIZED)
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, plain) != ours  # the penalties did something


def test_penalized_greedy_is_batch_invariant(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompts = varied_prompts(400, count=6, seed=41)
    alone = engine.generate([prompts[0]], PENALIZED)[0]
    others = [
        SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=-1.0),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, seed=1, presence_penalty=2.0,
                       min_p=0.05, logprobs=3),
        SamplingParams(max_tokens=14, temperature=0.7, repetition_penalty=0.8,
                       logit_bias={3: 10.0}, min_tokens=5),
        SamplingParams(max_tokens=7, temperature=1.0, n=2, prompt_logprobs=1),
    ]
    together = engine.generate(prompts, [PENALIZED, *others])
    assert together[0] == alone
    chunked = tiny_engine_factory(max_num_batched_tokens=24)
    assert chunked.generate(prompts, [PENALIZED, *others])[0] == alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_back_eos_and_stop_tokens(tiny_engine_factory, temperature):
    engine = tiny_engine_factory()
    prompt = varied_prompts(400, 1, seed=42)[0]
    eos = engine.eos_token_ids[0]
    cases = [(dict(logit_bias={eos: 100.0}), None), (dict(logit_bias={42: 100.0},
                                                          stop_token_ids=[42]), 42)]
    for extra, stop_reason in cases:
        params = SamplingParams(max_tokens=20, temperature=temperature, seed=0, min_tokens=4,
                                **extra)
        engine.add_request("m", prompt, params)
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
        tokens = [t for o in outs for t in o.new_token_ids]
        banned = {eos, 42} & set(extra["logit_bias"])
        assert len(tokens) == 5 and not banned & set(tokens[:4]), tokens
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_reason


def test_out_of_vocabulary_logit_bias_is_rejected(tiny_engine_factory):
    engine = tiny_engine_factory()
    vocab = engine.model_config.vocab_size
    params = SamplingParams(logit_bias={vocab: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        engine.validate([1, 2, 3], params)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("bad", [1, 2, 3], params)
    assert not engine.has_unfinished_requests()
    engine.validate([1, 2, 3], SamplingParams(logit_bias={vocab - 1: 1.0}))
