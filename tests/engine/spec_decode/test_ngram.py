from __future__ import annotations

import numpy as np
import pytest

from kvserve.engine.spec_decode.ngram import NgramProposer, propose_ngram


def test_proposes_what_followed_the_longest_match():
    tokens = [1, 2, 3, 4, 5, 6, 9, 3, 4, 7, 2, 3, 4]
    # "2 3 4" (n=3) occurs at 1..3 only; "3 4" alone would pick the later 7.
    assert propose_ngram(tokens, 3, periodic=False) == [5, 6, 9]


def test_most_recent_occurrence_wins_among_equal_lengths():
    tokens = [8, 1, 2, 5, 8, 1, 2, 6, 0, 1, 2]
    assert propose_ngram(tokens, 2, max_n=2, min_n=2) == [6, 0]


def test_no_match_and_short_contexts():
    assert propose_ngram([1, 2, 3, 4], 3) == []
    assert propose_ngram([], 3) == []
    assert propose_ngram([7], 3, min_n=1) == []
    assert propose_ngram([7, 7], 3, min_n=1) == [7, 7, 7]
    assert propose_ngram([7, 7], 3) == []  # min_n=2 needs 3 tokens
    assert propose_ngram([1, 2, 3, 1, 2, 3], 0) == []


def test_min_n_rejects_weaker_matches():
    tokens = [4, 9, 1, 2, 9]  # only a 1-gram match ("9")
    assert propose_ngram(tokens, 2, min_n=1) == [1, 2]
    assert propose_ngram(tokens, 2, min_n=2) == []


def test_continuation_shorter_than_k():
    tokens = [5, 1, 2, 3, 1, 2]  # "1 2" matched at 1..2, then only "3 1 2" follows
    assert propose_ngram(tokens, 6, periodic=False) == [3, 1, 2]
    # Periodic: the text repeats with period 3, so the proposal goes on copying.
    assert propose_ngram(tokens, 6) == [3, 1, 2, 3, 1, 2]


def test_match_right_before_the_end_and_runs():
    tokens = [3, 4, 4, 4, 4]  # "4 4 4" ends one before the end
    assert propose_ngram(tokens, 3, periodic=False) == [4]
    assert propose_ngram(tokens, 3) == [4, 4, 4]


def test_max_n_caps_the_match_and_bad_bounds():
    tokens = [1, 2, 3, 4, 5, 0, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5]
    # With max_n=4 "2 3 4 5" ties and the most recent (followed by 6) wins;
    # with max_n=5 "1 2 3 4 5" is longer and wins.
    assert propose_ngram(tokens, 1, max_n=4) == [6]
    assert propose_ngram(tokens, 1, max_n=5) == [0]
    with pytest.raises(ValueError):
        propose_ngram(tokens, 1, max_n=1, min_n=2)


def _reference(tokens, k, max_n, min_n):
    """Obvious O(len * n) version (non-periodic)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_matches_the_obvious_version_on_random_contexts():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(0, 40))).tolist()
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        assert propose_ngram(tokens, k, max_n, min_n, periodic=False) == \
            _reference(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)


def test_proposer_follows_a_growing_context():
    prop = NgramProposer(k=3)
    tokens = [1, 2, 3, 4]
    assert prop.propose("a", tokens) == []
    for t in [1, 2]:
        tokens.append(t)
    assert prop.propose("a", tokens) == [3, 4, 1]
    tokens += [9] * 200  # grows past the initial capacity
    assert prop.propose("a", tokens, k=2) == [9, 9]
    assert prop.propose("a", tokens) == propose_ngram(tokens, 3)
    # A different list under the same id (shrunk, or changed) is taken afresh.
    assert prop.propose("a", [5, 6, 5]) == []
    assert prop.propose("a", [5, 6, 5, 6]) == [5, 6, 5]
    prop.release("a")
    assert prop.propose("a", [1, 2, 1, 2], k=1) == [1]


def test_long_context_is_fast():
    import time
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, 8192).tolist()  # frequent tokens: many candidates
    prop = NgramProposer(k=4)
    prop.propose("r", tokens)
    start = time.perf_counter()
    for _ in range(200):
        prop.propose("r", tokens)
    assert (time.perf_counter() - start) / 200 < 2e-3
