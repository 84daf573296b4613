"""The pooler on its own (chunks summed, a restart after preemption forgets the old
sum, "last" takes the prompt's last row) and the pooling request's own checks."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.runner.pooling import Pooler, PoolRows
from kvserve.scheduler.sampling_params import SamplingParams


def unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=0)


def test_mean_sums_chunks_and_a_restart_starts_over():
    rows = torch.randn(10, 8)
    pooler = Pooler()
    assert pooler.observe(rows, [PoolRows("a", "mean", 0, 4, True, False)]) == {}
    # preempted and recomputed from its first token: the first chunk's sum is dropped
    assert pooler.observe(rows, [PoolRows("a", "mean", 4, 3, True, False)]) == {}
    done = pooler.observe(rows, [PoolRows("a", "mean", 7, 3, False, True)])
    assert torch.allclose(done["a"], unit(rows[4:10].mean(dim=0)), atol=1e-6)
    assert pooler._sums == {}


def test_last_takes_the_final_row_and_two_requests_share_a_step():
    rows = torch.randn(6, 8)
    done = Pooler().observe(rows, [PoolRows("a", "last", 0, 2, True, True),
                                   PoolRows("b", "mean", 2, 4, True, True)])
    assert torch.allclose(done["a"], unit(rows[1]), atol=1e-6)
    assert torch.allclose(done["b"], unit(rows[2:].mean(dim=0)), atol=1e-6)
    assert abs(done["a"].norm().item() - 1) < 1e-6


@pytest.mark.parametrize("kwargs", [dict(pooling="max"), dict(pooling="mean", max_tokens=2),
                                    dict(pooling="last", n=2)])
def test_a_pooling_request_generates_nothing(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**{"max_tokens": 1, **kwargs})
