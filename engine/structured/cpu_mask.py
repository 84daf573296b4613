"""Grammar bitmasks applied to logits rows on the CPU, in place.

xgrammar's CPU kernel writes -inf token by token, so a row that allows a few dozen
of 49k tokens (most rows of a JSON grammar: between strings, only punctuation, keys
and digits fit) costs it ~0.2 ms; 16 such rows were 1.8 ms of a 28 ms decode step.
Here a sparse row (most of its 32-token words all zero) is filled with -inf at once
and its allowed logits, unpacked from the nonzero words only, are put back: 16 rows
in 0.4 ms instead of 3.1 ms (bench/structured_overhead.py's figures). A dense row
(free text inside a string) stays with xgrammar's kernel, which is fast for those."""
from __future__ import annotations

import torch
import xgrammar as xgr

_BITS = torch.arange(32, dtype=torch.int32)
_OFFSETS = torch.arange(32, dtype=torch.int64)


def apply_bitmask_cpu_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [N, V] float on the CPU; bitmask [N', ceil(V' / 32)] int32, bit t of a
    row set where token t is allowed; rows: the rows of both to mask. In a sparse
    row, tokens past the bitmask's vocabulary (a padded embedding) are masked too."""
    index = torch.tensor(rows, dtype=torch.int64)
    words = bitmask[index]
    nonzero = words != 0
    sparse = nonzero.sum(dim=1) * 2 < words.shape[1]
    if not logits.is_contiguous():
        sparse[:] = False
    if bool(sparse.any()):
        sparse_rows, vocab = index[sparse], logits.shape[1]
        r, w = nonzero[sparse].nonzero(as_tuple=True)
        positions = (w * 32).unsqueeze(-1) + _OFFSETS  # [words, 32] tokens of each word
        allowed = ((words[sparse][r, w].unsqueeze(-1) >> _BITS) & 1).bool() \
            & (positions < vocab)
        flat = (sparse_rows[r].unsqueeze(-1) * vocab + positions)[allowed]
        kept = logits.view(-1)[flat]
        logits[sparse_rows] = float("-inf")
        logits.view(-1)[flat] = kept
    if not bool(sparse.all()):
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=index[~sparse].tolist())
