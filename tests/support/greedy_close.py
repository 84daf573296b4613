"""Greedy outputs of two numerically different paths (an int4 kernel and its float
expansion, say) compared the way a near-tie allows: token-identical until they
first differ, and there each path's choice is within `atol` nats of the other's
best, so the split is a near-tie and not a wrong logit (vLLM's logprobs-close check,
made stricter by the bound on the gap)."""
from __future__ import annotations

from kvserve.scheduler.sampling_params import SamplingParams


def greedy_with_logprobs(engine, prompt: list[int], max_tokens: int, k: int = 5):
    """[(token id, its logprob, {top-k id: logprob})] of one greedy request."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=k)
    engine.add_request("greedy", prompt, params)
    steps: list = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            steps += [(lp.token_id, lp.logprob, dict(lp.top)) for lp in out.logprobs or ()]
    assert len(steps) == max_tokens
    return steps


def assert_greedy_close(ours: list, theirs: list, atol: float = 0.15) -> int:
    """Returns how many leading tokens agree (all of them when nothing split)."""
    for i, ((a, a_lp, a_top), (b, b_lp, b_top)) in enumerate(zip(ours, theirs)):
        if a != b:
            assert b in a_top and a in b_top, f"token {i}: {a} vs {b}, not in each other's top-k"
            assert a_lp - a_top[b] <= atol and b_lp - b_top[a] <= atol, \
                f"token {i}: {a} vs {b} split by more than a near-tie ({a_top}, {b_top})"
            return i
        assert abs(a_lp - b_lp) <= atol, f"token {i} ({a}): logprob {a_lp} vs {b_lp}"
    return len(ours)
