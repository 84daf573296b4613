"""engine/sampling/draw.py: inverse-CDF draws, the sampler's and the verifier's."""
from __future__ import annotations

import torch

from kvserve.engine.sampling.draw import draw, pick, uniforms


def test_a_uniform_lands_on_the_token_whose_share_holds_it():
    weights = torch.tensor([[0.2, 0.0, 0.5, 0.3]])
    cases = {0.0: 0, 0.19: 0, 0.2: 2, 0.69: 2, 0.7: 3, 0.999: 3}
    for u, token in cases.items():
        assert pick(weights, torch.tensor([u])).item() == token, u


def test_weights_need_not_be_normalised():
    weights = torch.rand(64, 100)
    u = torch.rand(64)
    assert torch.equal(pick(weights * 37.5, u), pick(weights / weights.sum(-1, True), u))


def test_zero_weight_tokens_are_never_picked_even_at_the_edges():
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    u = torch.stack([torch.tensor(0.0), below_one, torch.tensor(0.5)])
    weights = torch.zeros(3, 1000)
    weights[:, 10] = 0.3
    weights[:, 500] = 0.7  # everything after it weighs nothing
    assert pick(weights, u).tolist() == [10, 500, 500]
    # totals of every magnitude, ending in zero weights: u x total stays below total
    for scale in (1e-30, 3e-7, 0.77, 1.5, 3.0, 1e6):
        ragged = torch.zeros(3, 50_000)
        ragged[:, :40_000] = scale * torch.rand(3, 40_000)
        assert (pick(ragged, u) < 40_000).all(), scale
    assert pick(torch.full((1, 8), float("nan")), u[:1]).item() in range(8)


def test_positions_batch_like_rows():
    weights = torch.rand(4, 3, 20)
    u = torch.rand(4, 3)
    flat = pick(weights.reshape(12, 20), u.reshape(12))
    assert torch.equal(pick(weights, u), flat.reshape(4, 3))


def test_draws_follow_the_weights():
    weights = torch.tensor([1.0, 3.0, 0.0, 6.0])
    rows = 40_000
    tokens = draw(weights.expand(rows, 4).contiguous(), [None] * rows)
    freq = torch.bincount(tokens, minlength=4).float() / rows
    assert torch.allclose(freq, weights / weights.sum(), atol=0.01)
    assert freq[2] == 0


def test_a_seeded_row_draws_from_its_own_generator_whatever_the_batch():
    weights = torch.rand(5, 300)
    alone = draw(weights[2:3], [torch.Generator().manual_seed(9)])
    gens = [None, None, torch.Generator().manual_seed(9), None, None]
    in_batch = draw(weights, gens)
    assert in_batch[2] == alone[0]
    # one number per seeded row per draw, nothing else taken from its generator
    gen = torch.Generator().manual_seed(9)
    uniforms(1, weights.device, [gen])
    expect = torch.Generator().manual_seed(9)
    torch.rand(1, generator=expect)
    assert torch.equal(gen.get_state(), expect.get_state())
