"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of a
request's last n tokens, with no extra weights.

The match is the longest n in [min_n, max_n] that occurs earlier in the context, and
of its occurrences the most recent one (nearest context is the likeliest to be copied
again when a model edits or repeats its input). Occurrences may overlap the suffix,
so a run "x x x" or a loop with a short period also matches.

Defaults: max_n 4 (longer matches rarely change the choice, and a 4-token match is
already strong evidence); min_n 2, because a single-token match (a frequent token
such as "the" or ",") mostly proposes the wrong continuation, and every rejected
draft token still costs a query token in the verification pass (real compute on a
CPU, budget in the scheduler). Both are parameters.

With `periodic` (the default) a continuation that runs into the end of the context
goes on as a copy of itself, the way an overlapping LZ77 copy does: the match says
that the text repeats with period d = len - start, so the proposal is the last d
tokens repeated, always k tokens long. Without it a proposal stops at the end of
the context and may be shorter than k.

Cost: one vectorised comparison over the context for the last token, then at most
max_n - 1 gathers over the (usually few) positions holding that token; the context is
kept per request in an append-only numpy buffer (`NgramProposer`), so a step does not
convert the Python token list again."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_MAX_N = 4
DEFAULT_MIN_N = 2


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, max_n: int = DEFAULT_MAX_N,
                  min_n: int = DEFAULT_MIN_N, periodic: bool = True) -> list[int]:
    """Up to k proposed tokens following `tokens` (prompt + generated, oldest first);
    [] when no n-gram of length >= min_n occurs earlier, or k == 0."""
    if not 1 <= min_n <= max_n:
        raise ValueError("need 1 <= min_n <= max_n")
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    if k <= 0 or length < min_n + 1:
        return []
    start = _continuation_start(arr, max_n, min_n)
    if start is None:
        return []
    if periodic:
        return np.resize(arr[start:length], k).tolist()
    return arr[start:start + k].tolist()


def _continuation_start(arr: np.ndarray, max_n: int, min_n: int) -> int | None:
    """Where the continuation of the best match begins: the position after the most
    recent earlier occurrence of the longest matching suffix; None without one."""
    length = arr.shape[0]
    # Candidate occurrences end at e <= length - 2 (a token must follow them).
    ends = np.flatnonzero(arr[:length - 1] == arr[length - 1])
    if ends.size == 0:
        return None
    matched = np.ones(ends.shape, dtype=np.int64)
    alive = np.ones(ends.shape, dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        back = ends - j
        alive &= back >= 0
        alive &= arr[np.maximum(back, 0)] == arr[length - 1 - j]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return None
    # Most recent among the longest: ends are ascending.
    return int(ends[np.flatnonzero(matched == best)[-1]]) + 1


class _Buffer:
    """A request's tokens as an append-only int64 array with spare capacity."""

    __slots__ = ("data", "size")

    def __init__(self, tokens: Sequence[int]):
        self.data = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.size = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        need = self.size + len(tokens)
        if need > self.data.shape[0]:
            grown = np.empty(2 * need, dtype=np.int64)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        self.data[self.size:need] = tokens
        self.size = need

    def view(self) -> np.ndarray:
        return self.data[:self.size]


class NgramProposer:
    """Per-request buffers for `propose_ngram`. Give it each step the request's full
    token list (prompt + accepted tokens); only the new tail is copied. The list may
    only grow between calls; if it shrank or its last known token changed, the buffer
    is rebuilt. Call `release` when a request finishes."""

    def __init__(self, k: int, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N,
                 periodic: bool = True):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.k, self.max_n, self.min_n, self.periodic = k, max_n, min_n, periodic
        self._buffers: dict[str, _Buffer] = {}

    def propose(self, request_id: str, token_ids: Sequence[int],
                k: int | None = None) -> list[int]:
        """Up to k (default self.k) proposed tokens for this request's next positions."""
        buf = self._sync(request_id, token_ids)
        return propose_ngram(buf.view(), self.k if k is None else k, self.max_n,
                             self.min_n, self.periodic)

    def release(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)

    def _sync(self, request_id: str, token_ids: Sequence[int]) -> _Buffer:
        buf = self._buffers.get(request_id)
        n = len(token_ids)
        if buf is None or n < buf.size or (
                buf.size and int(buf.data[buf.size - 1]) != token_ids[buf.size - 1]):
            buf = self._buffers[request_id] = _Buffer(token_ids)
        elif n > buf.size:
            buf.extend(token_ids[buf.size:])
        return buf
