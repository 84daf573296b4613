from __future__ import annotations

import torch

from kvserve.engine.sampling import sample
from kvserve.scheduler.sampling_params import SamplingParams


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0)] * 4
    assert torch.equal(sample(logits, params, [None] * 4), logits.argmax(-1))


def test_a_given_argmax_is_used_unless_an_adjustment_applies():
    from kvserve.engine.sampling.adjustments import build_adjustments
    from kvserve.scheduler.request import Request

    logits = torch.tensor([[0.0, 5.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy], [None], argmax=torch.tensor([2])).tolist() == [2]
    biased = SamplingParams(temperature=0.0, logit_bias={2: 10.0})
    adjust = build_adjustments([Request("r", [1], biased)], 3, logits.device)
    assert sample(logits, [biased], [None], adjust, argmax=torch.tensor([1])).tolist() == [2]


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=1.0, top_k=1)] * 3 + \
             [SamplingParams(temperature=1.0, top_p=1e-6)] * 3
    assert torch.equal(sample(logits, params, [None] * 6), logits.argmax(-1))


def test_top_k_never_leaves_the_top_k():
    logits = torch.randn(1, 100)
    allowed = set(logits[0].topk(5).indices.tolist())
    params = [SamplingParams(temperature=2.0, top_k=5)]
    draws = {int(sample(logits, params, [None])[0]) for _ in range(200)}
    assert draws <= allowed and len(draws) > 1


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    params = [SamplingParams(temperature=1.0, seed=0)]
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(4000):
        counts[sample(probs.log(), params, [gen])[0]] += 1
    assert torch.allclose(counts / 4000, probs[0], atol=0.03)
