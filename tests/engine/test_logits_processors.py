"""Each logits processor against its formula written out directly, on small tensors;
how the sampler combines them (greedy rows included); SamplingParams validation."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvserve.engine.sampling import sample
from kvserve.engine.sampling.adjustments import build_adjustments
from kvserve.engine.sampling.processors import apply_min_p, apply_penalties, token_counts
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams

V = 12
EOS = 11


def request(prompt, output=(), eos=(EOS,), **params) -> Request:
    params.setdefault("temperature", 0.0)
    req = Request("r", list(prompt), SamplingParams(max_tokens=50, **params), eos)
    req.token_ids.extend(output)
    return req


def processed(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    adj = build_adjustments(reqs, logits.shape[-1], logits.device)
    return logits if adj is None else adj.apply(logits)


def test_token_counts_count_each_list():
    lists = [[1, 2, 2, 5], [], [0, 0, 0, 11]]
    counts = token_counts(lists, V, torch.device("cpu"))
    for row, ids in zip(counts.tolist(), lists):
        assert row == [Counter(ids)[t] for t in range(V)]


def test_penalties_follow_the_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    prompts = [[1, 2, 3], [4], [5, 5]]
    outputs = [[2, 2, 7], [4, 9, 9, 9], []]
    rep, freq, pres = [1.5, 0.7, 2.0], [0.5, -1.0, 2.0], [1.0, 0.25, -2.0]
    reqs = [request(p, o, repetition_penalty=r, frequency_penalty=f, presence_penalty=q)
            for p, o, r, f, q in zip(prompts, outputs, rep, freq, pres)]
    got = processed(logits, reqs)
    want = logits.clone()
    for i in range(3):
        counts = Counter(outputs[i])
        for t in range(V):
            x = want[i, t].item()
            if t in counts or t in prompts[i]:
                x = x / rep[i] if x > 0 else x * rep[i]
            want[i, t] = x - freq[i] * counts[t] - pres[i] * (counts[t] > 0)
    assert torch.allclose(got, want, atol=1e-6)


def test_apply_penalties_without_repetition_leaves_prompt_tokens_alone():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    counts = torch.tensor([[0.0, 3.0, 1.0]])
    got = apply_penalties(logits, None, counts, None, torch.tensor([0.5]), torch.tensor([1.0]))
    assert torch.allclose(got, torch.tensor([[2.0, -1.0 - 1.5 - 1.0, 0.5 - 0.5 - 1.0]]))


def test_rows_without_adjustments_are_untouched_and_no_work_without_any():
    logits = torch.randn(3, V)
    plain = request([1, 2])
    assert build_adjustments([plain, plain], V, logits.device) is None
    got = processed(logits, [plain, request([1], [3], frequency_penalty=1.0), plain])
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    assert got[1, 3] == logits[1, 3] - 1.0


def test_logit_bias_is_added_and_steers_greedy_rows():
    logits = torch.randn(2, V)
    bias = {3: 100.0, 7: -5.5}
    reqs = [request([1], logit_bias=bias), request([1])]
    got = processed(logits, reqs)
    want = logits.clone()
    want[0, 3] += 100.0
    want[0, 7] -= 5.5
    assert torch.allclose(got, want)
    tokens = sample(logits, [r.params for r in reqs], [None, None],
                    build_adjustments(reqs, V, logits.device))
    assert tokens.tolist() == [3, int(logits[1].argmax())]


def test_logit_bias_is_clamped_and_accepts_string_keys():
    params = SamplingParams(logit_bias={"5": 250, 6: -1e9, 7: 0.5})
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: 0.5}
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    for outputs, banned in [((), {EOS, 4}), ((1, 2), {EOS, 4}), ((1, 2, 3), set())]:
        req = request([1], outputs, min_tokens=3, stop_token_ids=[4])
        got = processed(logits, [req])[0]
        assert {t for t in range(V) if got[t] == -math.inf} == banned, outputs


def test_min_tokens_with_ignore_eos_masks_only_stop_tokens():
    req = request([1], min_tokens=2, stop_token_ids=[4, 999], ignore_eos=True)  # 999 > V
    got = processed(torch.zeros(1, V), [req])[0]
    assert {t for t in range(V) if got[t] == -math.inf} == {4}


def test_greedy_row_never_picks_a_masked_eos():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 50.0
    req = request([1], min_tokens=1)
    tokens = sample(logits, [req.params], [None], build_adjustments([req], V, logits.device))
    assert tokens.item() != EOS


def test_append_token_agrees_with_the_mask():
    req = request([1], min_tokens=2, stop_token_ids=[4])
    for token in (4, EOS):  # as if sampled regardless: the first 2 tokens cannot stop
        req.append_token(token, 1000)
        assert not req.finished
    req.append_token(4, 1000)
    assert req.finish_reason == "stop" and req.stop_reason == 4


def test_min_p_follows_the_formula():
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [1.0, 1.0, 1.0, 1.0]])
    min_p = torch.tensor([0.3, 0.9])
    probs = logits.softmax(-1)
    keep = probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
    got = apply_min_p(logits, min_p)
    assert torch.equal(got == -math.inf, ~keep)
    assert torch.equal(got[keep], logits[keep])


def test_min_p_applies_after_temperature():
    logits = torch.tensor([[2.0, 1.0, -5.0]])  # p(1)/p(0) = e^-1 at T=1, e^-0.5 at T=2
    params = SamplingParams(temperature=2.0, min_p=0.5)
    draws = {int(sample(logits, [params], [None])[0]) for _ in range(300)}
    assert draws == {0, 1}
    cold = SamplingParams(temperature=1.0, min_p=0.5)
    assert {int(sample(logits, [cold], [None])[0]) for _ in range(100)} == {0}


@pytest.mark.parametrize("field, value", [
    ("min_p", -0.1), ("min_p", 1.5), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("logprobs", 21),
    ("logprobs", -1), ("prompt_logprobs", 21), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"x": 1.0}),
])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_needs_processing_only_for_penalties_bias_or_min_tokens():
    assert not SamplingParams(temperature=0.5, top_k=5, min_p=0.1, logprobs=3).needs_processing
    for extra in [dict(presence_penalty=0.1), dict(frequency_penalty=-0.1),
                  dict(repetition_penalty=1.1), dict(logit_bias={1: 1.0}),
                  dict(min_tokens=1)]:
        assert SamplingParams(**extra).needs_processing, extra
