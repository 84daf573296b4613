"""Beam search (use_beam_search, server/beam_search.py) against transformers'
generate(num_beams=n, num_return_sequences=n, do_sample=False, ...): the search fed
the reference model's own logprobs, then the server on the engine, token for token,
on a tiny random-weight model and on the default model; and the 400s."""
from __future__ import annotations

import pytest
import torch

from kvserve.server.beam_search import BeamSearch, Hypothesis, max_beam_width
from kvserve.server.detokenizer import IncrementalDetokenizer
from tests.support.http import assert_error, parse_sse, wait_idle
from tests.support.reference import load_reference, varied_prompts
from tests.support.server import engine_http_client

MODEL = "tiny"
MAX_NEW = 10


# -- transformers, the reference ----------------------------------------------------
@torch.inference_mode()
def hf_beams(model, prompt: list[int], width: int, max_new: int, eos: list[int] | None,
             length_penalty: float = 1.0, early_stopping=False, **kw):
    """transformers' n best beams: (generated tokens, the ending token included;
    their scores), best first."""
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                         do_sample=False, max_new_tokens=max_new,
                         length_penalty=length_penalty, early_stopping=early_stopping,
                         eos_token_id=eos or None, pad_token_id=0,
                         return_dict_in_generate=True, output_scores=True, **kw)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # -1: no token there
    seqs = [out.sequences[i, len(prompt):len(prompt) + n].tolist()
            for i, n in enumerate(lengths)]
    return seqs, out.sequences_scores.tolist()


@torch.inference_mode()
def searched(model, prompt: list[int], search: BeamSearch) -> list[Hypothesis]:
    """Our search, each step fed the reference model's log_softmax top-k."""
    while not search.done:
        ids = torch.tensor([prompt + list(b.tokens) for b in search.live])  # one length
        top = model(ids).logits[:, -1].float().log_softmax(-1).topk(search.k)
        search.step([list(zip(i, v)) for i, v in zip(top.indices.tolist(),
                                                     top.values.tolist())])
    return search.results()


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_dir):
    return load_reference(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


@torch.inference_mode()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()


PROMPTS = varied_prompts(400, count=2, seed=3, lengths=(5, 17))
# (which greedy tokens are made EOS, length_penalty, early_stopping): a random model
# seldom ends, so tokens it likes stand in for EOS; a penalty <= 0 favours short
# hypotheses, so some win.
SEARCHES = [((0,), 0.0, False), ((1, 4), 1.0, True), ((), 2.0, "never"),
            ((2,), -0.5, False), ((0,), 0.0, "never")]


# -- the search alone, on the reference's own logprobs ----------------------------------
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("ends, length_penalty, early_stopping", SEARCHES)
def test_the_search_is_transformers_beam_search(tiny_ref, width, ends, length_penalty,
                                                early_stopping):
    ended = 0
    for prompt in PROMPTS:
        g = greedy(tiny_ref, prompt, 6)
        eos = [g[i] for i in ends]
        want, scores = hf_beams(tiny_ref, prompt, width, MAX_NEW, eos, length_penalty,
                                early_stopping)
        got = searched(tiny_ref, prompt, BeamSearch(width, MAX_NEW, eos, (), length_penalty,
                                                    early_stopping))
        assert [list(h.tokens) for h in got] == want
        assert [h.score for h in got] == pytest.approx(scores, abs=1e-4)
        for h in got:
            assert h.finish_reason == ("stop" if h.tokens[-1] in eos else "length")
            assert h.ended_by_token == (h.finish_reason == "stop")
        ended += sum(h.finish_reason == "stop" for h in got)
    if ends and length_penalty <= 0:
        assert ended, "no hypothesis ended at EOS: the case tests nothing"


@pytest.mark.parametrize("stops", [["e"], ["a", "o"]])
def test_stop_strings_end_hypotheses_as_transformers_stop_strings(tiny_ref, tiny_tok, stops):
    """A continuation whose text shows a stop string ends, as transformers'
    stop_strings do (it matches token strings where we match decoded text, so the two
    can part where a character is split over tokens: not in these)."""
    for text in ["The capital of", "def add(a"]:
        prompt = tiny_tok.encode(text)
        want, _ = hf_beams(tiny_ref, prompt, 3, MAX_NEW, [tiny_tok.eos_token_id],
                           0.0, stop_strings=stops, tokenizer=tiny_tok)
        search = BeamSearch(3, MAX_NEW, [tiny_tok.eos_token_id], (), 0.0, False,
                            lambda: IncrementalDetokenizer(tiny_tok, prompt, stops))
        got = searched(tiny_ref, prompt, search)
        assert [list(h.tokens) for h in got] == want
        assert any(h.finish_reason == "stop" for h in got)


def _uniform_steps(search: BeamSearch, tops) -> None:
    while not search.done:
        search.step([tops] * len(search.live))


def test_scores_and_early_stopping_by_hand():
    """Token 9 ends (EOS). Step 1: 9 (-0.1) ends with score -0.1 / 1; the beams go
    on with 1 and 2. early_stopping True stops once `width` hypotheses are done."""
    tops = [(9, -0.1), (1, -0.5), (2, -1.0), (3, -2.0)]
    s = BeamSearch(2, 5, eos_ids=[9], length_penalty=1.0, early_stopping=True)
    assert s.k == 4
    s.step([tops])
    assert [h.tokens for h in s.finished] == [(9,)] and s.finished[0].score == -0.1
    assert [b.tokens for b in s.live] == [(1,), (2,)]
    s.step([tops, tops])  # 1,9 (-0.6) ends: score -0.3; 2,9 ranks third: not a hypothesis
    assert [h.tokens for h in s.finished] == [(9,), (1, 9)]
    assert s.finished[1].score == pytest.approx(-0.3)
    assert s.done and s.steps == 2
    s = BeamSearch(2, 5, eos_ids=[9], length_penalty=1.0, early_stopping=False)
    _uniform_steps(s, tops)
    # the best beam, 1 1 (-1.0) at length 2, scores -0.5 < -0.3: nothing can improve
    assert s.steps == 2 and not s.improvable
    s = BeamSearch(2, 5, eos_ids=[9], length_penalty=2.0, early_stopping="never")
    _uniform_steps(s, tops)  # scored at max_tokens, a long beam could still win
    assert s.steps == 5


@pytest.mark.parametrize("length_penalty", [7.1e16, -7.1e16, 1e308, -1e308])
def test_a_length_penalty_past_floats_range_still_ranks_beams(length_penalty):
    """length ** length_penalty overflows (or underflows to 0) a float: scores 0 and
    -inf instead of an OverflowError (a 500, found by the schema fuzzer)."""
    tops = [(9, -0.1), (1, -0.5), (2, -1.0), (3, -2.0)]
    s = BeamSearch(2, 4, eos_ids=[9], length_penalty=length_penalty)
    _uniform_steps(s, tops)
    results = s.results()
    assert len(results) == 2 and all(isinstance(h.score, float) for h in results)
    assert s.score(-1.0, 1) == -1.0  # 1 ** anything: the logprob itself
    assert s.score(-1.0, 3) == (0.0 if length_penalty > 0 else float("-inf"))
    assert s.score(0.0, 3) == 0.0


def test_max_tokens_ends_every_beam_and_cut_short_ranks_live_beams():
    tops = [(1, -0.5), (2, -1.0), (3, -2.0), (4, -3.0)]
    s = BeamSearch(2, 3, length_penalty=1.0)
    _uniform_steps(s, tops)
    assert [(h.tokens, h.finish_reason) for h in s.results()] == [
        ((1, 1, 1), "length"), ((1, 1, 2), "length")]
    s = BeamSearch(2, 3)
    s.step([tops])
    assert [(h.tokens, h.finish_reason) for h in s.cut_short()] == [
        ((1,), "abort"), ((2,), "abort")]


def test_stop_token_ids_end_with_their_id_and_widen_the_candidates():
    s = BeamSearch(2, 4, eos_ids=[9], stop_ids=[7])
    assert s.k == 3 * 2  # transformers: (1 + end tokens) * width
    s.step([[(7, -0.1), (9, -0.2), (1, -0.3), (2, -0.4), (3, -0.5), (4, -0.6)]])
    assert [(h.tokens, h.stop_reason) for h in s.finished] == [((7,), 7), ((9,), None)]
    assert max_beam_width(1) == 10 and max_beam_width(3) == 5


def test_bad_searches_are_refused():
    for kw in [dict(width=0, max_tokens=4), dict(width=2, max_tokens=0),
               dict(width=2, max_tokens=4, early_stopping="sometimes")]:
        with pytest.raises(ValueError):
            BeamSearch(**kw)


# -- the server, on the engine ------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tiny_engine_factory):
    with engine_http_client(tiny_engine_factory("llama"), MODEL) as http:
        yield http


def post(srv, path="/v1/completions", **body) -> dict:
    body = {"model": MODEL, "use_beam_search": True, "return_token_ids": True, **body}
    r = srv.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("width", [2, 4])
def test_completions_match_transformers(srv, tiny_ref, width):
    eos = srv.engine.tokenizer.eos_token_id
    prompt = PROMPTS[1]
    g = greedy(tiny_ref, prompt, 3)
    cases = [dict(stop_token_ids=[g[0]], length_penalty=0.0),  # some end at the stop token
             dict(length_penalty=1.0, early_stopping=True),
             dict(ignore_eos=True, length_penalty=2.0, early_stopping="never")]
    for case in cases:
        body = post(srv, prompt=prompt, n=width, max_tokens=MAX_NEW, temperature=0.7, **case)
        ends = [] if case.get("ignore_eos") else [eos, *case.get("stop_token_ids", ())]
        want, _ = hf_beams(tiny_ref, prompt, width, MAX_NEW, ends, case["length_penalty"],
                           case.get("early_stopping", False))
        choices = body["choices"]
        assert [c["index"] for c in choices] == list(range(width))
        assert [c["token_ids"] for c in choices] == want, case
        for c in choices:
            stopped = c["token_ids"][-1] in ends
            assert c["finish_reason"] == ("stop" if stopped else "length")
            if stopped and c["token_ids"][-1] != eos:
                assert c["stop_reason"] == c["token_ids"][-1]
        assert body["usage"]["completion_tokens"] == sum(len(w) for w in want)
    assert wait_idle(srv.engine)


def test_a_huge_length_penalty_is_served(srv):
    """The schema fuzzer's request: length_penalty 7e16 (finite, so valid) over a chat."""
    body = post(srv, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                n=2, max_tokens=4, length_penalty=7.087649566737995e16, seed=-37)
    assert len(body["choices"]) == 2
    assert wait_idle(srv.engine)


def test_some_beams_end_at_a_stop_token(srv, tiny_ref):
    prompt = PROMPTS[1]
    stop = greedy(tiny_ref, prompt, 1)[0]
    body = post(srv, prompt=prompt, n=4, max_tokens=MAX_NEW, stop_token_ids=[stop],
                length_penalty=0.0)
    reasons = [c["finish_reason"] for c in body["choices"]]
    assert "stop" in reasons and body["choices"][0]["text"] == ""  # the stop token alone
    assert body["choices"][0]["token_ids"] == [stop]


def test_logprobs_are_the_chosen_tokens_and_sum_to_the_score(srv, tiny_ref):
    prompt = PROMPTS[0]
    body = post(srv, prompt=prompt, n=2, max_tokens=6, logprobs=3, ignore_eos=True)
    _, scores = hf_beams(tiny_ref, prompt, 2, 6, None, 1.0)
    for c, score in zip(body["choices"], scores):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(c["token_ids"]) == 6
        for token, top in zip(lp["tokens"], lp["top_logprobs"]):
            assert token in top and len(top) <= 4  # the top 3, and the chosen one
        assert sum(lp["token_logprobs"]) / 6 == pytest.approx(score, abs=1e-3)


def test_chat_streams_the_whole_result_at_the_end(srv):
    msgs = [{"role": "user", "content": "The capital of France"}]
    whole = post(srv, "/v1/chat/completions", messages=msgs, n=2, max_tokens=8)
    r = srv.post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "n": 2, "max_tokens": 8, "use_beam_search": True,
        "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    chunks = parse_sse(r.content)
    texts, finish = {}, {}
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
            finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    usage = chunks[-1]["usage"]  # its prompt was cached by then
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_stop_strings_cut_the_choices(srv):
    body = post(srv, prompt="The capital of", n=3, max_tokens=MAX_NEW, stop=["e"],
                length_penalty=0.0)
    assert any(c["finish_reason"] == "stop" and c["stop_reason"] == "e"
               for c in body["choices"])
    assert not any("e" in c["text"] for c in body["choices"])


def test_echo_puts_the_prompt_first(srv):
    body = post(srv, prompt="The capital of", n=2, max_tokens=4, echo=True)
    assert all(c["text"].startswith("The capital of") for c in body["choices"])


@pytest.mark.parametrize("extra, param", [
    ({"n": 11}, "n"),  # 2 * 11 candidates: past the engine's 20 logprobs
    ({"n": 6, "stop_token_ids": [5, 6]}, "n"),  # (1 + 3 end tokens) * 6 > 20
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {"5": 3}}, "logit_bias"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_beam_search_cannot_honour_is_a_400(srv, extra, param, stream):
    body = {"model": MODEL, "prompt": "The capital of", "max_tokens": 4,
            "use_beam_search": True, "stream": stream, **extra}
    err = assert_error(srv.post("/v1/completions", json=body), 400, param)
    assert param in err["message"]


def test_a_tool_grammar_is_a_400_naming_tools(srv):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "use_beam_search": True, "tools": [tool],
            "tool_choice": "required"}
    assert_error(srv.post("/v1/chat/completions", json=body), 400, "tools")


# -- the default model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_ref(default_model_dir):
    return load_reference(default_model_dir)  # float32


@pytest.mark.parametrize("width", [2, 4])
def test_default_model_chat_matches_transformers(smol_url, smol_ref, width):
    import httpx

    body = {"model": "smol", "messages": [{"role": "user", "content": "What is 2+2?"}],
            "n": width, "max_tokens": 16, "use_beam_search": True, "return_token_ids": True}
    r = httpx.post(f"{smol_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    want, _ = hf_beams(smol_ref, out["prompt_token_ids"], width, 16, [2])
    assert [c["token_ids"] for c in out["choices"]] == want
    reasons = [c["finish_reason"] for c in out["choices"]]
    assert "stop" in reasons, reasons  # some beams end at EOS
    for c in out["choices"]:
        assert c["finish_reason"] == ("stop" if c["token_ids"][-1] == 2 else "length")
        assert "<|im_end|>" not in c["message"]["content"]
