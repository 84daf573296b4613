"""Speculative decoding through the real engine (tiny random models, float32): greedy
outputs token-identical to plain decoding for each proposer in mixed batches, seeded
sampling identical too, drafts verified and rolled back without leaking a block,
and the empirical distribution of sampled continuations unchanged (chi-square)."""
from __future__ import annotations

import collections
import random

import pytest
import torch

from kvserve.engine.config.engine_config import SpeculativeConfig
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def repetitive_prompts(vocab: int, count: int = 32, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat phrases (n-gram drafts find matches), of many lengths (the
    long ones are prefilled in chunks beside others' verification steps)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        noise = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 300 if i % 4 else 8))]
        prompts.append(noise + phrase * rng.randint(2, 6))
    return prompts


def engine_with(factory, spec: SpeculativeConfig | None, **overrides):
    return factory(dtype="float32", speculative=spec, max_num_seqs=32, **overrides)


def assert_nothing_left(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller random model (one layer, other weights) with the tiny tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=7,
                           num_hidden_layers=1)


@pytest.fixture(scope="module")
def plain_greedy(tiny_engine_factory):
    """32 prompts and their greedy outputs without speculation."""
    plain = engine_with(tiny_engine_factory, None)
    prompts = repetitive_prompts(plain.model_config.vocab_size)
    return prompts, plain.generate(prompts, GREEDY)


@pytest.mark.parametrize("spec", [
    SpeculativeConfig("ngram", num_tokens=4, disable_batch_size=0),
    SpeculativeConfig("ngram", num_tokens=2, ngram_min=1, disable_batch_size=0),
    SpeculativeConfig("early-exit", num_tokens=3, draft_layers=1, disable_batch_size=0),
], ids=["ngram-k4", "ngram-k2-min1", "early-exit-k3"])
def test_greedy_outputs_identical_in_mixed_batches(tiny_engine_factory, plain_greedy, spec):
    prompts, want = plain_greedy
    engine = engine_with(tiny_engine_factory, spec)
    assert engine.generate(prompts, GREEDY) == want
    stats = engine.speculator.stats
    assert stats.num_drafts > 50 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert_nothing_left(engine)


def test_draft_model_greedy_identical(tiny_engine_factory, plain_greedy, draft_dir,
                                      tiny_model_dir):
    """A draft model of its own (its cache paged by the target's block tables) gives
    the same outputs; the target as its own draft has every draft accepted."""
    prompts, want = plain_greedy
    for model, everything_accepted in ((draft_dir, False), (tiny_model_dir("llama"), True)):
        spec = SpeculativeConfig("draft", num_tokens=3, disable_batch_size=0, model=str(model))
        engine = engine_with(tiny_engine_factory, spec)
        assert engine.generate(prompts, GREEDY) == want
        stats = engine.speculator.stats
        assert stats.num_drafts > 50
        if everything_accepted:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert_nothing_left(engine)


def test_seeded_sampling_identical_with_penalties_top_k_and_top_p(tiny_engine_factory):
    # Low temperatures: a random model's logits are nearly flat, and drafts are only
    # accepted where the target's distribution has some mass on them.
    params = [SamplingParams(max_tokens=40, temperature=0.05 * (1 + i % 3), top_p=0.9, seed=i,
                             ignore_eos=True, frequency_penalty=0.3 * (i % 2),
                             top_k=5 if i % 4 == 0 else 0, min_tokens=5) for i in range(16)]
    plain = engine_with(tiny_engine_factory, None)
    prompts = repetitive_prompts(plain.model_config.vocab_size, 16, seed=1)
    want = plain.generate(prompts, params)
    engine = engine_with(tiny_engine_factory,
                         SpeculativeConfig("ngram", num_tokens=4, ngram_min=1,
                                           disable_batch_size=0))
    assert engine.generate(prompts, params) == want
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert_nothing_left(engine)


def test_opt_out_and_large_batches_verify_nothing(tiny_engine_factory):
    engine = engine_with(tiny_engine_factory,
                         SpeculativeConfig("ngram", num_tokens=4, disable_batch_size=4))
    prompts = repetitive_prompts(engine.model_config.vocab_size, 8)
    engine.generate(prompts[:2], SamplingParams(max_tokens=16, temperature=0.0,
                                                speculative=False))
    assert engine.speculator.stats.num_drafts == 0
    engine.add_request("big-batch", prompts[0], GREEDY)
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(f"big-batch-{i}", prompt, GREEDY)
    while len(engine.scheduler.running) < 8:  # admitted together
        engine.step()
    for _ in range(10):  # 8 running > 4: no drafts
        engine.step()
        assert engine.speculator.stats.num_drafts == 0
        assert not any(r.spec_token_ids for r in engine.scheduler.running)
    for rid in ["big-batch"] + [f"big-batch-{i}" for i in range(5)]:
        engine.abort_request(rid)
    engine.step()  # 2 running <= 4: drafts again
    assert any(r.spec_token_ids for r in engine.scheduler.running)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.speculator.stats.num_drafts > 0
    assert_nothing_left(engine)


def test_stop_token_among_accepted_drafts_ends_the_request_there(tiny_engine_factory):
    plain = engine_with(tiny_engine_factory, None)
    prompts = repetitive_prompts(plain.model_config.vocab_size, 8, seed=2)
    free_run = plain.generate(prompts, GREEDY)
    # stop at a token each continuation produces midway: it must end exactly there
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[out[len(out) // 2]]) for out in free_run]
    want = plain.generate(prompts, params)
    engine = engine_with(tiny_engine_factory,
                         SpeculativeConfig("ngram", num_tokens=4, ngram_min=1,
                                           disable_batch_size=0))
    assert engine.generate(prompts, params) == want
    assert_nothing_left(engine)


def homogeneity_p(a: collections.Counter, b: collections.Counter, min_expected=5.0) -> float:
    """p-value of a chi-square test that two samples come from one distribution;
    cells expected to hold fewer than min_expected of either are pooled."""
    cells = sorted(set(a) | set(b))
    obs = torch.tensor([[a[c] for c in cells], [b[c] for c in cells]], dtype=torch.float64)
    expected = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    small = (expected < min_expected).any(0)
    obs = torch.cat([obs[:, ~small], obs[:, small].sum(1, keepdim=True)], 1)
    expected = torch.cat([expected[:, ~small], expected[:, small].sum(1, keepdim=True)], 1)
    stat = ((obs - expected) ** 2 / expected).sum()
    dof = obs.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def vocab12_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-vocab12"), "llama", vocab_size=12)


def test_sampled_distribution_unchanged_chi_square(tiny_engine_factory, vocab12_model):
    """A tiny-vocabulary model (12 tokens): 3-token continuations sampled 20,000
    times with and without n-gram speculation are one distribution (chi-square
    test of homogeneity, p > 0.01), at temperature 1 and with top-p."""
    for top_p in (1.0, 0.8):
        counts = []
        for spec in (None, SpeculativeConfig("ngram", num_tokens=3, ngram_min=1,
                                             disable_batch_size=0)):
            engine = tiny_engine_factory(dtype="float32", speculative=spec,
                                         max_num_seqs=512, max_num_batched_tokens=4096,
                                         model=str(vocab12_model))
            prompt = list(range(3, 12)) * 2  # every token has a match: always a draft
            params = SamplingParams(max_tokens=3, temperature=1.0, top_p=top_p,
                                    ignore_eos=True, n=500)
            outs = engine.generate([prompt] * 40, params)
            counts.append(collections.Counter(tuple(o) for o in outs))
            assert sum(counts[-1].values()) == 20_000
        assert engine.speculator.stats.num_accepted_tokens > 1000
        assert homogeneity_p(*counts) > 0.01, top_p


def test_nan_in_verification_rows_fails_that_request_alone(tiny_engine_factory):
    engine = engine_with(tiny_engine_factory,
                         SpeculativeConfig("ngram", num_tokens=3, ngram_min=1,
                                           disable_batch_size=0))
    prompts = repetitive_prompts(engine.model_config.vocab_size, 2, seed=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    while not engine.scheduler.running or not engine.scheduler.running[0].spec_token_ids:
        engine.step()
    # Verification rows come last, in running order: the last request with drafts
    # owns the last row.
    victim = [r for r in engine.scheduler.running if r.spec_token_ids][-1].request_id
    model, plain = engine.runner.model, engine.runner.model.compute_logits

    def nan_for_the_victims_rows(hidden):
        logits = plain(hidden)
        logits[-1] = float("nan")
        return logits

    model.compute_logits = nan_for_the_victims_rows
    try:
        outs = engine.step()
    finally:
        model.compute_logits = plain
    failed = [o for o in outs if o.finish_reason == "error"]
    assert [o.request_id for o in failed] == [victim] and "NaN/inf" in failed[0].error
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_left(engine)
