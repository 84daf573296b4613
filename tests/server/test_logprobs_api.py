"""logprobs, echo and the logit processors over HTTP, checked against transformers:
every returned logprob must equal log_softmax of the reference model's logits at that
position, and the token strings and offsets must fit the text."""
from __future__ import annotations

import math

import openai
import pytest
import torch

from tests.support.http import assert_error, parse_sse, wait_idle
from tests.support.reference import load_reference
from tests.support.server import engine_http_client

MODEL = "tiny"
TIMEOUT = 120.0
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def srv(tiny_engine_factory):
    with engine_http_client(tiny_engine_factory("llama", max_num_batched_tokens=32), MODEL, TIMEOUT) as http:
        yield http


@pytest.fixture(scope="module")
def ref_logprobs(tiny_model_dir):
    """token ids -> [len, vocab] log_softmax of the reference model at every position."""
    model = load_reference(tiny_model_dir("llama"))

    @torch.inference_mode()
    def run(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return run


@pytest.fixture(scope="module")
def offline(tiny_engine_factory):
    """(prompt ids, **SamplingParams fields) -> the token ids an engine of its own
    generates; seeded sampling does not depend on the batch, so they must match."""
    from kvserve.scheduler.sampling_params import SamplingParams

    engine = tiny_engine_factory("llama")
    return lambda ids, **params: engine.generate([ids], SamplingParams(**params))[0]


def post(srv, path="/v1/completions", **body) -> dict:
    body.setdefault("model", MODEL)
    r = srv.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(srv, text: str) -> list[int]:
    return srv.engine.tokenizer.encode(text)


def token_text(srv, token_id: int) -> str:
    return srv.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def test_completion_logprobs_match_the_reference(srv, ref_logprobs):
    body = post(srv, prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True,
                logprobs=3, return_token_ids=True)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == 8
    prompt = ids_of(srv, PROMPT)
    # greedy: the chosen token is the reference argmax, and its logprob matches
    generated = []
    for i in range(8):
        ref = ref_logprobs(prompt + generated)[-1]
        best = int(ref.argmax())
        generated.append(best)
        assert lp["tokens"][i] == token_text(srv, best)
        assert math.isclose(lp["token_logprobs"][i], float(ref[best]), abs_tol=1e-4)
        top = ref.topk(3)
        expected = {token_text(srv, int(t)): float(v) for v, t in zip(top.values, top.indices)}
        assert lp["top_logprobs"][i].keys() == expected.keys()
        for k, v in expected.items():
            assert math.isclose(lp["top_logprobs"][i][k], v, abs_tol=1e-4)
    # offsets index the returned text token by token
    text = choice["text"]
    assert lp["text_offset"][0] == 0
    for i, tok in enumerate(lp["tokens"]):
        assert text[lp["text_offset"][i]:].startswith(tok)


def test_sampled_tokens_get_their_own_logprob(srv, ref_logprobs, offline):
    """With sampling the chosen token need not be the best; its logprob is still raw."""
    sampling = dict(max_tokens=6, temperature=1.5, seed=3, ignore_eos=True)
    body = post(srv, prompt=PROMPT, logprobs=0, **sampling)
    lp = body["choices"][0]["logprobs"]
    prompt = ids_of(srv, PROMPT)
    ids = offline(prompt, **sampling)
    assert lp["tokens"] == [token_text(srv, t) for t in ids]
    ref = ref_logprobs(prompt + ids)
    assert any(t != int(ref[len(prompt) + i - 1].argmax()) for i, t in enumerate(ids))
    for i, t in enumerate(ids):
        assert math.isclose(lp["token_logprobs"][i], float(ref[len(prompt) + i - 1, t]),
                            abs_tol=1e-4)
        assert list(lp["top_logprobs"][i]) == [lp["tokens"][i]]  # logprobs=0: itself only


def test_logprobs_do_not_change_seeded_sampling(srv):
    common = dict(prompt=PROMPT, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    plain = post(srv, **common)["choices"][0]["text"]
    assert post(srv, logprobs=5, **common)["choices"][0]["text"] == plain


def test_echo_with_logprobs_covers_the_prompt(srv, ref_logprobs):
    prompt = ids_of(srv, PROMPT)
    body = post(srv, prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True,
                echo=True, logprobs=2)
    choice = body["choices"][0]
    assert choice["text"].startswith(PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = ref_logprobs(prompt)
    for i in range(1, len(prompt)):
        assert lp["tokens"][i] == token_text(srv, prompt[i])
        assert math.isclose(lp["token_logprobs"][i], float(ref[i - 1, prompt[i]]),
                            abs_tol=1e-4)
    assert lp["text_offset"][len(prompt)] == len(PROMPT)  # generated text follows


def test_echo_of_a_long_chunked_prompt(srv, ref_logprobs):
    """The prompt is longer than the step's token budget (32): its logprobs come from
    several chunks and must still line up."""
    prompt = ids_of(srv, (PROMPT + " Paged attention stores keys and values.") * 4)
    assert len(prompt) > 64
    body = post(srv, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = body["choices"][0]["logprobs"]
    ref = ref_logprobs(prompt)
    got = lp["token_logprobs"][1:len(prompt)]
    want = [float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, want))


def test_echo_without_logprobs_and_token_prompts(srv):
    ids = ids_of(srv, PROMPT)
    a = post(srv, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    b = post(srv, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["choices"][0]["text"].startswith(PROMPT)
    assert a["choices"][0]["logprobs"] is None


def test_echo_streaming_sends_the_prompt_first(srv):
    with srv.stream("POST", "/v1/completions", json=dict(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, ignore_eos=True,
            echo=True, logprobs=1, stream=True)) as r:
        chunks = parse_sse(r.read())
    whole = post(srv, prompt=PROMPT, max_tokens=5, temperature=0, ignore_eos=True,
                 echo=True, logprobs=1)["choices"][0]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    offsets = [t for c in chunks for t in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def test_chat_logprobs_match_the_reference(srv, ref_logprobs):
    from kvserve.server.chat_template import render_chat

    messages = [{"role": "user", "content": PROMPT}]
    body = post(srv, "/v1/chat/completions", messages=messages, max_tokens=5,
                temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    prompt = render_chat(srv.engine.tokenizer, messages)
    generated = []
    for entry in content:
        ref = ref_logprobs(prompt + generated)[-1]
        best = int(ref.argmax())
        generated.append(best)
        assert entry["token"] == token_text(srv, best)
        assert entry["bytes"] == list(entry["token"].encode())
        assert math.isclose(entry["logprob"], float(ref[best]), abs_tol=1e-4)
        assert [t["token"] for t in entry["top_logprobs"]] == [
            token_text(srv, int(t)) for t in ref.topk(2).indices]


def test_chat_logprobs_false_means_none(srv):
    body = post(srv, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}],
                max_tokens=2)
    assert body["choices"][0]["logprobs"] is None


def test_sdk_reads_logprobs(srv):
    with openai.OpenAI(base_url=str(srv.base_url) + "/v1", api_key="x",
                       max_retries=0) as client:
        resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                          logprobs=2, temperature=0)
        assert len(resp.choices[0].logprobs.tokens) == 3
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
            logprobs=True, top_logprobs=1, temperature=0)
        assert len(chat.choices[0].logprobs.content) == 3


def test_logit_bias_forces_and_forbids_tokens(srv, offline):
    forced = ids_of(srv, " Paris")[0]
    body = post(srv, prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True,
                logit_bias={str(forced): 100}, logprobs=0)
    assert body["choices"][0]["logprobs"]["tokens"] == [token_text(srv, forced)] * 4
    greedy = offline(ids_of(srv, PROMPT), max_tokens=1, temperature=0)[0]
    banned = offline(ids_of(srv, PROMPT), max_tokens=1, temperature=0,
                     logit_bias={greedy: -100})[0]
    assert banned != greedy
    after = post(srv, prompt=PROMPT, max_tokens=1, temperature=0, ignore_eos=True,
                 logit_bias={str(greedy): -100}, logprobs=0)
    assert after["choices"][0]["logprobs"]["tokens"][0] == token_text(srv, banned)


def test_frequency_penalty_breaks_repetition(srv):
    prompt = "0 1 2 3 4 5 6 7 8 9 10 11 12"
    common = dict(prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    plain = post(srv, **common)["choices"][0]["logprobs"]["tokens"]
    penalised = post(srv, frequency_penalty=2.0, **common)["choices"][0]["logprobs"]["tokens"]
    assert len(set(penalised)) >= len(set(plain))
    assert max(penalised.count(t) for t in penalised) <= max(plain.count(t) for t in plain)


@pytest.mark.parametrize("body,param", [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"1000000": 5}}, "logit_bias"),
])
def test_bad_sampling_fields_are_400(srv, body, param):
    r = srv.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert_error(r, 400, param=param)


def test_vllm_bench_serve_request_shape(srv):
    """What `vllm bench serve` sends, field for field."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "repetition_penalty": 1.0, "logprobs": None}
    with srv.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = parse_sse(r.read())
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["choices"][0]["logprobs"] is None for c in chunks[:-1])


def test_nothing_leaks(srv):
    assert wait_idle(srv.engine)


def test_echo_with_max_tokens_0_scores_the_prompt_only(srv, ref_logprobs):
    """lm-eval-harness's loglikelihood request: the prompt's logprobs, nothing more."""
    prompt = ids_of(srv, PROMPT)
    body = post(srv, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt)
    ref = ref_logprobs(prompt)
    assert all(math.isclose(lp["token_logprobs"][i], float(ref[i - 1, prompt[i]]),
                            abs_tol=1e-4) for i in range(1, len(prompt)))
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(prompt)
    with srv.stream("POST", "/v1/completions", json=dict(
            model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, stream=True)) as r:
        chunks = parse_sse(r.read())
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT


def test_max_tokens_0_without_echo_is_400(srv):
    r = srv.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert_error(r, 400)
