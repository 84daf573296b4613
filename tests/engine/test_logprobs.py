"""Logprobs and prompt logprobs from the engine against transformers (same tiny
random-weight model, float32): raw log_softmax of the model's logits, whatever the
sampling parameters, through chunked prefill, prefix caching, preemption and n > 1."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kvserve.engine.platform.outputs import TokenLogprob
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import load_reference, varied_prompts

ATOL = 1e-4


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return load_reference(tiny_model_dir("llama"))


@torch.inference_mode()
def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the log distribution of the token after ids[:i + 1]."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = defaultdict(list)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def check(item: TokenLogprob, token: int, row: torch.Tensor, k: int) -> None:
    assert item.token_id == token
    assert abs(item.logprob - row[token].item()) < ATOL
    lo = int((row > row[token] + ATOL).sum()) + 1
    hi = int((row >= row[token] - ATOL).sum())
    assert lo <= item.rank <= hi
    assert len(item.top) == k
    ids = [t for t, _ in item.top]
    values = torch.tensor([v for _, v in item.top])
    assert torch.equal(values, values.sort(descending=True).values)
    assert torch.allclose(values, row.topk(k).values, atol=ATOL)
    assert torch.allclose(row[ids], values, atol=ATOL)


def check_outputs(model, prompt: list[int], outs, k: int) -> None:
    tokens = tokens_of(outs)
    items = [lp for o in outs for lp in o.logprobs]
    assert len(items) == len(tokens)
    rows = ref_logprobs(model, prompt + tokens)[len(prompt) - 1:]
    for i, (token, item) in enumerate(zip(tokens, items)):
        check(item, token, rows[i], k)


def check_prompt(model, prompt: list[int], items, k: int) -> None:
    assert len(items) == len(prompt) and items[0] is None
    rows = ref_logprobs(model, prompt)
    for i in range(1, len(prompt)):
        check(items[i], prompt[i], rows[i - 1], k)


def test_sampled_token_logprobs_are_raw_and_match_transformers(tiny_engine_factory, ref):
    engine = tiny_engine_factory()
    prompts = varied_prompts(400, count=3, seed=30, lengths=(7, 33, 18))
    params = {
        "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5),
        # Temperature, penalties and bias change the sampling, not the logprobs.
        "random": SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3,
                                 repetition_penalty=1.3, logit_bias={5: 3.0},
                                 ignore_eos=True, logprobs=3),
        "k0": SamplingParams(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True,
                             logprobs=0),
        "none": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    }
    outs = run(engine, {rid: (prompts[i % 3], p) for i, (rid, p) in enumerate(params.items())})
    for i, (rid, p) in enumerate(params.items()):
        if p.logprobs is None:
            assert all(o.logprobs is None for o in outs[rid])
        else:
            check_outputs(ref, prompts[i % 3], outs[rid], p.logprobs)
        assert all(o.prompt_logprobs is None for o in outs[rid])
    assert all(o.logprobs[0].rank == 1 for o in outs["greedy"])


def test_chunked_prompt_logprobs_match_and_skip_the_prefix_cache(tiny_engine_factory, ref):
    engine = tiny_engine_factory(max_num_batched_tokens=16)
    prompt = varied_prompts(400, 1, seed=31, lengths=(70,))[0]  # 5 chunks
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=4, logprobs=2)
    cold = run(engine, {"cold": (prompt, params)})["cold"]
    check_prompt(ref, prompt, cold[0].prompt_logprobs, 4)
    assert all(o.prompt_logprobs is None for o in cold[1:])
    check_outputs(ref, prompt, cold, 2)
    # The prompt's blocks are cached now; a request for prompt logprobs ignores them.
    warm = run(engine, {"warm": (prompt, params)})["warm"]
    assert warm[0].num_cached_tokens == 0
    assert warm[0].prompt_logprobs == cold[0].prompt_logprobs
    assert tokens_of(warm) == tokens_of(cold)
    # ... but it registered its blocks: an ordinary request hits them.
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    hit = run(engine, {"plain": (prompt, plain)})["plain"]
    assert hit[0].num_cached_tokens == 64 and tokens_of(hit) == tokens_of(cold)
    assert len(engine.runner.sampler.prompt) == 0


def test_short_prompts_and_n_siblings_get_prompt_logprobs(tiny_engine_factory, ref):
    engine = tiny_engine_factory()
    prompt = varied_prompts(400, 1, seed=32, lengths=(21,))[0]
    params = SamplingParams(max_tokens=4, n=3, seed=9, ignore_eos=True, prompt_logprobs=0)
    outs = run(engine, {"g": (prompt, params), "one": ([7], SamplingParams(
        max_tokens=2, ignore_eos=True, prompt_logprobs=3))})
    assert outs["one"][0].prompt_logprobs == [None]
    firsts = [next(o for o in outs["g"] if o.index == i).prompt_logprobs for i in range(3)]
    check_prompt(ref, prompt, firsts[0], 0)
    assert firsts[1] == firsts[0] and firsts[2] == firsts[0]


def test_prompt_logprobs_survive_preemption_mid_prompt(tiny_engine_factory, ref):
    # 8 blocks of 16: "a" decodes while "b"'s long prompt fills the cache, so b is
    # preempted mid-prompt and recomputed from its first token.
    engine = tiny_engine_factory(num_kv_blocks=8, max_num_batched_tokens=8)
    prompts = varied_prompts(400, 2, seed=33, lengths=(40, 100))
    recomputed = []
    plan = engine.runner.sampler.prompt.plan

    def spy(scheduled, query_starts):
        recomputed.extend(s.request.request_id for s in scheduled
                          if s.request.num_preemptions and s.request.needs_prompt_logits)
        return plan(scheduled, query_starts)

    engine.runner.sampler.prompt.plan = spy
    outs = run(engine, {
        "a": (prompts[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)),
        "b": (prompts[1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                         prompt_logprobs=2)),
    })
    assert "b" in recomputed
    check_prompt(ref, prompts[1], outs["b"][0].prompt_logprobs, 2)
    assert len(engine.runner.sampler.prompt) == 0


def test_abort_mid_prompt_drops_partial_prompt_logprobs(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_batched_tokens=16)
    prompt = varied_prompts(400, 1, seed=34, lengths=(60,))[0]
    engine.add_request("x", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
    engine.step()
    assert len(engine.runner.sampler.prompt) == 1
    (out,) = engine.abort_request("x")
    assert out.prompt_logprobs is None
    assert len(engine.runner.sampler.prompt) == 0


def test_logprobs_do_not_perturb_seeded_sampling(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompts = varied_prompts(400, count=3, seed=35)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=77,
                            ignore_eos=True)
    alone = engine.generate([prompts[0]], seeded)[0]
    with_lp = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=77,
                             ignore_eos=True, logprobs=5, prompt_logprobs=5)
    others = [SamplingParams(max_tokens=10, temperature=1.0, logprobs=2),
              SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=1)]
    assert engine.generate([prompts[0]], with_lp)[0] == alone
    assert engine.generate(prompts, [with_lp, *others])[0] == alone
