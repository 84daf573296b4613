"""vLLM's allowed_token_ids and bad_words in the real engine (tiny random model,
float32): greedy outputs equal to transformers' generate with the same constraint
(prefix_allowed_tokens_fn, bad_words_ids), random rows that only ever draw allowed
tokens, bad words matched against the generated tokens only (vLLM's rule, not
transformers'), the same masks on every speculative verification row, the same
outputs under async scheduling, and the engine's own checks of the token ids."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from kvserve.engine.config.engine_config import SpeculativeConfig
from kvserve.engine.core.request_checks import check_request
from kvserve.engine.sampling.adjustments import build_adjustments, disallowed_mask
from kvserve.engine.sampling.verify import verify
from kvserve.engine.sampling.verify_positions import verification_adjustments
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import BadWords, SamplingParams
from tests.support.reference import assert_same_tokens, load_reference, varied_prompts

CPU = torch.device("cpu")


def greedy(n: int = 16, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **extra)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int, **kw) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory(dtype="float32")


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return load_reference(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def vocab(engine) -> int:
    return engine.model_config.vocab_size


# -- allowed_token_ids ---------------------------------------------------------------

def test_allowed_token_ids_greedy_matches_transformers(engine, ref, vocab):
    prompts = varied_prompts(vocab, count=3, seed=50, lengths=(4, 17, 40))
    plain = engine.generate(prompts, greedy())
    rng = random.Random(5)
    sets = [sorted(rng.sample(range(vocab), vocab // 3)), [5, 17, 42], [9]]
    for allowed in sets:
        ours = engine.generate(prompts, greedy(allowed_token_ids=allowed))
        want = [hf_greedy(ref, p, 16, prefix_allowed_tokens_fn=lambda b, ids: allowed)
                for p in prompts]
        assert_same_tokens(ref, prompts, ours, want)
        assert {t for o in ours for t in o} <= set(allowed)
        assert ours != plain  # the mask bit
    assert engine.generate(prompts[:1], greedy(allowed_token_ids=[9]))[0] == [9] * 16


def test_allowed_token_ids_in_a_mixed_batch_change_no_other_row(engine, vocab):
    """Rows with and without the mask side by side (the mask rows picked out of the
    adjusted rows: logit_bias and penalties beside it), each as it is alone."""
    prompts = varied_prompts(vocab, count=4, seed=52, lengths=(6, 13, 30, 9))
    params = [greedy(12), greedy(12, allowed_token_ids=[3, 4, 5, 6, 7, 8]),
              greedy(12, logit_bias={11: 3.0}, frequency_penalty=0.5),
              greedy(12, allowed_token_ids=list(range(100, 200)), logit_bias={150: 50.0})]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert together == alone
    assert set(together[1]) <= set(range(3, 9))
    assert together[3] == [150] * 12  # a bias inside the allowed set still counts


def test_random_rows_only_draw_allowed_tokens(engine, vocab):
    allowed = [10, 20, 30, 40]
    params = SamplingParams(max_tokens=40, temperature=1.5, seed=3, ignore_eos=True,
                            allowed_token_ids=allowed, n=4)
    outs = engine.generate(varied_prompts(vocab, 2, seed=53), params)
    drawn = {t for o in outs for t in o}
    assert drawn <= set(allowed) and len(drawn) > 1


def test_the_mask_is_built_once_and_shared_by_a_requests_sequences():
    params = SamplingParams(allowed_token_ids=[1, 2], n=3)
    sibling = dataclasses.replace(params, n=1, seed=1)  # as Request.make_siblings does
    mask = disallowed_mask(params, 12, CPU)
    assert mask is disallowed_mask(sibling, 12, CPU)
    assert torch.nonzero(~mask).flatten().tolist() == [1, 2]
    other = SamplingParams(allowed_token_ids=[1, 2])
    assert disallowed_mask(other, 12, CPU) is not mask


# -- bad_words -----------------------------------------------------------------------

def test_bad_words_greedy_matches_transformers(engine, ref, vocab):
    """Words taken from each prompt's own greedy continuation so that they bite: a
    one-token word (banned at every step), and two- and three-token words whose
    prefix the continuation starts with (their last token banned right after). The
    prompts' last two tokens are in no word: transformers matches a prefix against
    the prompt too, vLLM (and kvserve) against the generated tokens only, and here
    the two cannot differ (test_bad_word_prefixes_are_matched_in_the_output_only)."""
    candidates = varied_prompts(vocab, count=12, seed=54, lengths=(5, 20, 33))
    picked = []
    for prompt, out in zip(candidates, engine.generate(candidates, greedy(24))):
        cases = [[[out[3]]], [out[:2]], [out[:3]],
                 [[out[5]], out[:2], out[1:4], [out[0], 77]]]
        if not set(prompt[-2:]) & {t for words in cases for w in words for t in w}:
            picked.append((prompt, out, cases))
    assert len(picked) >= 3
    for prompt, out, cases in picked[:3]:
        for words in cases:
            ours = engine.generate([prompt], greedy(24, bad_words_token_ids=words))[0]
            want = hf_greedy(ref, prompt, 24, bad_words_ids=words)
            assert_same_tokens(ref, [prompt], [ours], [want])
            assert ours != out, words
            for w in words:  # never generated, whole
                assert not any(ours[i:i + len(w)] == w for i in range(len(ours))), w


def test_bad_word_prefixes_are_matched_in_the_output_only(engine, ref, vocab):
    """vLLM's rule: [A, B] bans B after a generated A, not after a prompt that ends
    with A (transformers' NoBadWordsLogitsProcessor bans it there too)."""
    prompt = varied_prompts(vocab, 1, seed=55, lengths=(12,))[0]
    out = engine.generate([prompt], greedy(8))[0]
    a, b = prompt[-1], out[0]
    ours = engine.generate([prompt], greedy(8, bad_words_token_ids=[[a, b]]))[0]
    assert ours[0] == b
    assert hf_greedy(ref, prompt, 8, bad_words_ids=[[a, b]])[0] != b
    assert engine.generate([prompt], greedy(8, bad_words_token_ids=[[b]]))[0][0] != b


def test_bad_words_index():
    words = BadWords([[4], [1, 2], [7, 1, 3], [9, 1, 5], [4]])
    assert words.always == (4,) and words.reads_output
    prompt_then = lambda output: [1, 1] + output  # noqa: E731
    assert words.banned(prompt_then([]), 0) == [4]
    assert sorted(words.banned(prompt_then([1]), 1)) == [2, 4]
    assert sorted(words.banned(prompt_then([7, 1]), 2)) == [2, 3, 4]
    # [7, 1] with 7 in the prompt: only the two-token word's prefix is in the output
    assert sorted(words.banned([7, 1], 1)) == [2, 4]
    assert not BadWords([[3]]).reads_output


# -- speculative decoding: the same masks on every verification row ------------------

def _request(rid, params, prompt, output):
    req = Request(rid, prompt, params, eos_token_ids=(11,))
    req.token_ids += output
    return req


def test_verification_rows_are_masked_as_if_the_drafts_were_generated():
    vocab = 12
    reqs = [_request("allowed", greedy(allowed_token_ids=[1, 2, 3]), [5, 6], [2]),
            _request("words", greedy(bad_words_token_ids=[[4], [8, 9], [2, 8, 7]]),
                     [8], [2])]
    drafts = [[3, 9, 1], [8, 7, 8]]
    rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    adjusted = verification_adjustments(reqs, drafts, vocab, CPU).apply(logits)
    row = 0
    for req, d in zip(reqs, drafts):
        for j in range(len(d) + 1):
            twin = _request(req.request_id, req.params, req.token_ids[:req.num_prompt_tokens],
                            req.output_token_ids + d[:j])
            expect = build_adjustments([twin], vocab, CPU).apply(logits[row:row + 1])
            assert torch.equal(adjusted[row], expect[0]), (req.request_id, j)
            row += 1
    inf = torch.isinf(adjusted)
    assert inf[:4].sum(1).tolist() == [9] * 4  # three allowed tokens on each row
    # words: 4 always; 9 after a generated 8 (rows 1 and 3); 7 after 2, 8 (row 1)
    assert [sorted(torch.nonzero(r).flatten().tolist()) for r in inf[4:]] == \
        [[4], [4, 7, 9], [4], [4, 9]]


def test_greedy_verification_rejects_masked_drafts():
    """Raw argmax 4 on every row, but 4 is not allowed: a draft of 4 is rejected and
    the token emitted is the masked argmax; a draft of it is accepted."""
    vocab = 12
    logits = torch.zeros(3, vocab)
    logits[:, 4], logits[:, 6] = 10.0, 5.0
    req = _request("a", greedy(allowed_token_ids=[1, 6]), [5], [])
    assert verify(logits, [req], [[4, 6]], [None]) == [[6]]
    assert verify(logits, [req], [[6, 6]], [None]) == [[6, 6, 6]]
    words = _request("b", greedy(bad_words_token_ids=[[6, 6]]), [5], [])
    logits[:, 4] = 0.0  # argmax 6, and 6 after a generated 6 is banned
    assert verify(logits, [words], [[6, 6]], [None]) == [[6, 0]]


def test_speculative_outputs_equal_plain_ones(tiny_engine_factory, engine, vocab):
    rng = random.Random(8)
    phrase = [rng.randrange(3, vocab) for _ in range(4)]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(0, 20))] + phrase * 4
               for _ in range(4)]
    plain = engine.generate(prompts, greedy(32))
    banned = [t for t in range(3, vocab) if t not in phrase][:40] + [plain[0][5]]
    allowed = [t for t in range(vocab) if t not in banned]
    params = [greedy(32, allowed_token_ids=allowed),
              greedy(32, bad_words_token_ids=[[plain[1][2]], plain[1][5:7]]),
              greedy(32, bad_words_token_ids=[plain[2][:2], plain[2][3:6]],
                     allowed_token_ids=allowed),
              greedy(32)]
    want = tiny_engine_factory(dtype="float32", max_num_seqs=32).generate(prompts, params)
    spec = tiny_engine_factory(dtype="float32", speculative=SpeculativeConfig(
        "ngram", num_tokens=3, ngram_min=1, disable_batch_size=0), max_num_seqs=32)
    assert spec.generate(prompts, params) == want
    stats = spec.speculator.stats
    assert stats.num_drafts > 10 and stats.num_accepted_tokens > 0


# -- async scheduling ----------------------------------------------------------------

def test_async_scheduling_outputs_equal_and_only_word_prefixes_wait(tiny_engine_factory,
                                                                     engine, vocab):
    prompts = varied_prompts(vocab, count=3, seed=56, lengths=(7, 15, 26))
    plain = engine.generate(prompts, greedy(20))
    params = [greedy(20, allowed_token_ids=list(range(50, 300))),
              greedy(20, bad_words_token_ids=[[plain[1][1]]]),
              greedy(20, bad_words_token_ids=[plain[2][:2], plain[2][4:6]])]
    want = engine.generate(prompts, params)
    overlapping = tiny_engine_factory(dtype="float32", async_scheduling=True)
    assert overlapping.generate(prompts, params) == want
    # Planned before the step before reached the host (a pending token): the mask
    # and the one-token word; never the multi-token words, which read the output
    # (and hold back the whole step they are in, so they run on their own here).
    planned, outs = overlapping.scheduler.schedule, []
    overlapping.scheduler.schedule = lambda: outs.append(o := planned()) or o
    for names in (("r0", "r1"), ("r2",)):
        for name in names:
            i = int(name[1])
            overlapping.add_request(name, prompts[i], params[i])
        while overlapping.has_unfinished_requests():
            overlapping.step()
    fed = {s.request.request_id for o in outs for s in o.scheduled if s.num_pending}
    assert fed == {"r0", "r1"}


# -- the checks ----------------------------------------------------------------------

def test_params_and_engine_checks(engine, vocab):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1, -2])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words_token_ids=[[1], []])
    assert SamplingParams(bad_words_token_ids=[]).bad_words is None
    assert not SamplingParams().needs_processing
    assert SamplingParams(allowed_token_ids=[1]).needs_processing
    assert SamplingParams(bad_words_token_ids=[[1, 2]]).needs_processing
    for name, params in [("allowed_token_ids", SamplingParams(allowed_token_ids=[1, vocab])),
                         ("bad_words", SamplingParams(bad_words_token_ids=[[1, vocab]]))]:
        with pytest.raises(ValueError, match=name):
            check_request([1, 2], params, 100, vocab)
        with pytest.raises(ValueError, match=name):
            engine.add_request("bad", [1, 2, 3], params)
    assert not engine.has_unfinished_requests()
    check_request([1, 2], SamplingParams(allowed_token_ids=[vocab - 1],
                                         bad_words_token_ids=[[0, vocab - 1]]), 100, vocab)
