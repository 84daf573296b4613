from __future__ import annotations

import torch

from kvserve.engine.sampling.adjustments import build_adjustments
from kvserve.engine.sampling.verify_positions import draft_positions, verification_adjustments
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams

VOCAB = 12
CPU = torch.device("cpu")


def _request(rid, params, prompt, output):
    req = Request(rid, prompt, params, eos_token_ids=(11,))
    req.token_ids += output
    return req


def _as_if_generated(req, drafts):
    """The request as it would be had it generated the drafts itself."""
    twin = Request(req.request_id, req.token_ids[:req.num_prompt_tokens], req.params,
                   eos_token_ids=req.eos_token_ids)
    twin.token_ids += req.output_token_ids + list(drafts)
    return twin


def test_each_row_is_adjusted_as_if_the_drafts_were_generated():
    reqs = [
        _request("pen", SamplingParams(frequency_penalty=0.7, presence_penalty=0.3,
                                       repetition_penalty=1.3, temperature=1.0),
                 [1, 2, 3], [4, 4]),
        _request("plain", SamplingParams(temperature=0.0), [5], [6]),
        _request("mintok", SamplingParams(min_tokens=3, stop_token_ids=[10],
                                          logit_bias={2: 5.0, 7: -3.0}), [1], [9]),
    ]
    drafts = [[4, 8, 2], [6], [0, 11, 3]]
    rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
    adjusted = verification_adjustments(reqs, drafts, VOCAB, CPU).apply(logits)
    row = 0
    for req, d in zip(reqs, drafts):
        for j in range(len(d) + 1):
            twin = _as_if_generated(req, d[:j])
            single = build_adjustments([twin], VOCAB, CPU)
            one = logits[row:row + 1]
            expect = one if single is None else single.apply(one)
            assert torch.allclose(adjusted[row], expect[0]), (req.request_id, j)
            row += 1
    # min_tokens=3 with one token out: EOS and stop banned on rows 0 and 1 only.
    banned = adjusted[-4:, [10, 11]]
    assert torch.isinf(banned[:2]).all() and torch.isfinite(banned[2:]).all()


def test_no_adjustments_when_none_is_asked():
    reqs = [_request("a", SamplingParams(), [1, 2], [3])]
    assert verification_adjustments(reqs, [[1, 2]], VOCAB, CPU) is None
    assert [p.output_token_ids for p in draft_positions(reqs, [[1, 2]])] == \
        [[3], [3, 1], [3, 1, 2]]
