"""engine/sampling/peaks.py: the chunked argmax gives max(dim=-1)'s answer on every
kind of row a step can hold (ties, NaN, +-inf, a short last chunk, row views)."""
import pytest
import torch

from kvserve.engine.sampling.peaks import CHUNK, row_peaks


def rows_of_every_kind(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=gen)
    x[1, [7, vocab - 1]] = 50.0                 # a tie: the first place wins
    x[2, vocab - 1] = 50.0                      # the largest in the short last chunk
    x[3, [CHUNK + 3, 5]] = float("nan")         # NaN counts as largest, the first one
    x[4] = float("-inf")                        # nothing finite: index 0
    x[5, [vocab - 2, 9]] = float("inf")         # +inf ties
    x[6] = 1.0                                  # a flat row
    x[7, CHUNK - 1], x[7, CHUNK] = 9.0, 9.0     # a tie across a chunk boundary
    x[8, vocab - 1] = float("nan")              # NaN in the short chunk
    x[9, 0] = 40.0
    x[10, [3, vocab - 3]] = float("-inf")
    x[11, :] = -1e30
    return x


@pytest.mark.parametrize("vocab", [2 * CHUNK, 49152, 49152 + 77, 3 * CHUNK + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_max_over_the_last_dimension(vocab, dtype):
    x = rows_of_every_kind(vocab).to(dtype)
    want_peak, want_top = x.max(dim=-1)
    top, peak = row_peaks(x)
    assert top.dtype == torch.int64 and top.tolist() == want_top.tolist()
    torch.testing.assert_close(peak, want_peak, equal_nan=True, rtol=0, atol=0)


def test_row_views_and_small_vocabularies():
    x = rows_of_every_kind(4 * CHUNK + 5)
    picked = x[[9, 1, 3, 8, 2]]                 # a gathered copy
    strided = x[::2]                            # rows a stride apart
    narrow = x[:, : 4 * CHUNK]                  # rows longer than their view
    for view in (picked, strided, narrow, x[:, :100], x[:2], x[:0]):
        want_peak, want_top = view.max(dim=-1)
        top, peak = row_peaks(view)
        assert top.tolist() == want_top.tolist()
        torch.testing.assert_close(peak, want_peak, equal_nan=True, rtol=0, atol=0)
