"""The CPU bitmask apply gives exactly what xgrammar's own kernel gives, on sparse
rows (few tokens allowed), dense rows (few refused) and a mix, any vocabulary size."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from kvserve.engine.structured.cpu_mask import apply_bitmask_cpu_


def _bitmask(rows: int, vocab: int, allowed_share: list[float], gen) -> torch.Tensor:
    allowed = torch.stack([torch.rand(vocab, generator=gen) < share
                           for share in allowed_share[:rows]])
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    bitmask.zero_()
    for r in range(rows):
        for t in allowed[r].nonzero().flatten().tolist():
            bitmask[r, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    return bitmask


@pytest.mark.parametrize("vocab", [4096, 1000, 33])
@pytest.mark.parametrize("shares", [[0.002] * 6, [0.98] * 6,
                                    [0.002, 0.98, 0.0, 1.0, 0.5, 0.01]])
def test_matches_xgrammar(vocab, shares):
    gen = torch.Generator().manual_seed(vocab)
    bitmask = _bitmask(6, vocab, shares, gen)
    logits = torch.randn(8, vocab, generator=gen)
    rows = [0, 2, 3, 4, 5, 1]  # any order; rows 6 and 7 are free
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    apply_bitmask_cpu_(logits, bitmask, rows)
    assert torch.equal(logits, expected)
