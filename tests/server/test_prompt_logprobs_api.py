"""vLLM's prompt_logprobs over HTTP, checked against transformers: at every prompt
position the logprob and rank of the prompt's own token and the top k must be those
of log_softmax of the reference model's logits (float32), through chunked prefill
and a prefix-cache hit; on each completion choice, at the top of a chat completion."""
from __future__ import annotations

import math
from types import SimpleNamespace

import openai
import pytest
import torch

from kvserve.engine.platform.outputs import TokenLogprob
from kvserve.server.errors import APIError
from kvserve.server.logprobs import TokenText, vllm_prompt_logprobs
from kvserve.server.validation import prompt_logprobs_k
from tests.support.http import assert_error, wait_idle
from tests.support.reference import load_reference
from tests.support.server import engine_http_client

MODEL = "tiny"
TOL = 1e-4
CHUNK = 16  # the step's token budget: a longer prompt is prefilled in chunks
LONG = ("The capital of France is Paris. Paged attention stores keys and values "
        "in blocks, and a prefix cache shares them between requests. ") * 2


@pytest.fixture(scope="module")
def srv(tiny_engine_factory):
    engine = tiny_engine_factory("llama", dtype="float32", max_num_batched_tokens=CHUNK)
    with engine_http_client(engine, MODEL) as http:
        yield http


@pytest.fixture(scope="module")
def ref_logprobs(tiny_model_dir):
    """token ids -> [len, vocab] log_softmax of the reference model at every position."""
    model = load_reference(tiny_model_dir("llama"))

    @torch.inference_mode()
    def run(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return run


def post(srv, path="/v1/completions", **body) -> dict:
    body.setdefault("model", MODEL)
    r = srv.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def token_text(srv, token_id: int) -> str:
    return srv.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def check_position(srv, entry: dict, token: int, row: torch.Tensor, k: int) -> None:
    """One position's dict: the prompt token's logprob and rank, and the top k."""
    own = entry[str(token)]
    assert math.isclose(own["logprob"], float(row[token]), abs_tol=TOL)
    # its rank: 1 + the tokens likelier than it (a near-tie may go either way)
    likelier = int((row > row[token] + TOL).sum())
    assert likelier + 1 <= own["rank"] <= int((row >= row[token] - TOL).sum())
    top = {int(t): v for t, v in entry.items() if v["rank"] <= k}
    assert sorted(v["rank"] for v in top.values()) == list(range(1, k + 1))
    assert set(entry) == {str(t) for t in top} | {str(token)}
    want = row.topk(k).values.tolist() if k else []
    by_rank = [v["logprob"] for v in sorted(top.values(), key=lambda v: v["rank"])]
    assert all(math.isclose(a, b, abs_tol=TOL) for a, b in zip(by_rank, want))
    for t, v in top.items():  # the ids too, not just the values
        assert math.isclose(v["logprob"], float(row[t]), abs_tol=TOL)
    for t, v in entry.items():
        assert v["decoded_token"] == token_text(srv, int(t))


def check_prompt(srv, plp: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        check_position(srv, plp[i], ids[i], ref[i - 1], k)


def test_completion_prompt_logprobs_match_the_reference(srv, ref_logprobs):
    body = post(srv, prompt=LONG, max_tokens=2, temperature=0, prompt_logprobs=5,
                return_token_ids=True)
    choice = body["choices"][0]
    ids = choice["prompt_token_ids"]
    assert len(ids) > 3 * CHUNK  # its lists come from several chunks
    assert choice["logprobs"] is None  # the generated tokens' are not asked for
    check_prompt(srv, choice["prompt_logprobs"], ids, ref_logprobs(ids), 5)


def test_chat_prompt_logprobs_are_the_response_s_own(srv, ref_logprobs):
    from kvserve.server.chat_template import render_chat

    messages = [{"role": "user", "content": LONG}]
    body = post(srv, "/v1/chat/completions", messages=messages, max_tokens=2,
                temperature=0, prompt_logprobs=3, n=2)
    ids = render_chat(srv.engine.tokenizer, messages)
    assert len(ids) > 3 * CHUNK
    check_prompt(srv, body["prompt_logprobs"], ids, ref_logprobs(ids), 3)
    assert all("prompt_logprobs" not in c for c in body["choices"])


def test_a_prefix_cache_hit_gives_the_same_values(srv, ref_logprobs):
    """A prompt cached by a request without prompt_logprobs, then asked twice with
    them: every position still gets its lists, the same each time."""
    ids = srv.engine.tokenizer.encode(LONG + " Once more.")
    plain = [post(srv, prompt=ids, max_tokens=1)["usage"] for _ in range(2)]
    assert plain[1]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache works
    first, again = (post(srv, prompt=ids, max_tokens=1, prompt_logprobs=2)
                    ["choices"][0]["prompt_logprobs"] for _ in range(2))
    assert again == first
    check_prompt(srv, first, ids, ref_logprobs(ids), 2)


def test_zero_lists_the_prompt_token_alone(srv, ref_logprobs):
    ids = srv.engine.tokenizer.encode("The capital of France is")
    plp = post(srv, prompt=ids, max_tokens=1, prompt_logprobs=0)["choices"][0][
        "prompt_logprobs"]
    assert all(list(entry) == [str(t)] for entry, t in zip(plp[1:], ids[1:]))
    check_prompt(srv, plp, ids, ref_logprobs(ids), 0)


def test_every_choice_gets_its_own_prompt_s_lists(srv, ref_logprobs):
    a = srv.engine.tokenizer.encode("The capital of France is")
    b = srv.engine.tokenizer.encode("Paged attention stores keys")
    body = post(srv, prompt=[a, b], n=2, max_tokens=2, temperature=1.0, seed=1,
                prompt_logprobs=1)
    by_index = {c["index"]: c["prompt_logprobs"] for c in body["choices"]}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]
    check_prompt(srv, by_index[0], a, ref_logprobs(a), 1)
    check_prompt(srv, by_index[2], b, ref_logprobs(b), 1)


@pytest.mark.parametrize("logprobs, prompt_logprobs", [(1, 4), (4, 1)])
def test_echo_and_prompt_logprobs_keep_their_own_k(srv, ref_logprobs, logprobs,
                                                   prompt_logprobs):
    """Both read the engine's one list per prompt token, as long as the longer asks."""
    ids = srv.engine.tokenizer.encode("The capital of France is")
    choice = post(srv, prompt=ids, max_tokens=1, temperature=0, echo=True,
                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)["choices"][0]
    check_prompt(srv, choice["prompt_logprobs"], ids, ref_logprobs(ids), prompt_logprobs)
    echoed = choice["logprobs"]["top_logprobs"][1:len(ids)]
    assert all(logprobs <= len(top) <= logprobs + 1 for top in echoed)


def test_null_asks_for_none(srv):
    choice = post(srv, prompt="x", max_tokens=1, prompt_logprobs=None)["choices"][0]
    assert "prompt_logprobs" not in choice
    body = post(srv, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}],
                max_tokens=1, prompt_logprobs=None)
    assert "prompt_logprobs" not in body


def test_a_one_token_prompt_has_its_null_only(srv):
    ids = srv.engine.tokenizer.encode("The")[:1]
    choice = post(srv, prompt=ids, max_tokens=1, prompt_logprobs=2)["choices"][0]
    assert choice["prompt_logprobs"] == [None]


ROUTES = {"/v1/completions": {"prompt": "The capital"},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]}}


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("body", [
    {"prompt_logprobs": -2}, {"prompt_logprobs": 21}, {"prompt_logprobs": 1.5},
    {"prompt_logprobs": "three"}, {"prompt_logprobs": [1]},
    {"prompt_logprobs": -1},  # the whole vocabulary: over 20 tokens here
    {"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 0, "stream": True},
])
def test_bad_values_are_400_naming_the_field(srv, path, body):
    r = srv.post(path, json={"model": MODEL, "max_tokens": 1, **ROUTES[path], **body})
    assert_error(r, 400, param="prompt_logprobs")


def test_the_sdk_reads_them(srv):
    with openai.OpenAI(base_url=str(srv.base_url) + "/v1", api_key="x",
                       max_retries=0) as client:
        resp = client.completions.create(model=MODEL, prompt="The capital of France",
                                          max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = resp.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and all(isinstance(e, dict) for e in plp[1:])


def test_nothing_leaks(srv):
    assert wait_idle(srv.engine)


# -- units ----------------------------------------------------------------------------
def test_minus_one_is_the_whole_of_a_small_vocabulary():
    def k(value, stream=False, vocab=16):
        return prompt_logprobs_k(SimpleNamespace(prompt_logprobs=value, stream=stream), vocab)

    assert k(-1) == 16 and k(0) == 0 and k(20) == 20 and k(None) is None
    for bad in (dict(value=-1, vocab=21), dict(value=21), dict(value=-3),
                dict(value=2, stream=True)):
        with pytest.raises(APIError) as exc:
            k(**bad)
        assert exc.value.status == 400 and exc.value.param == "prompt_logprobs"


def test_the_wire_shape_is_vllm_s():
    """The prompt token first; one also in the top list keeps its place and takes the
    list's rank; -inf (impossible, e.g. masked) is -9999.0, as vLLM clamps it."""
    text = TokenText(None)
    entries = [None, TokenLogprob(7, -0.5, 1, [(7, -0.5), (3, -1.0)]),
               TokenLogprob(9, float("-inf"), 5, [(3, -0.1), (4, -0.2)])]
    got = vllm_prompt_logprobs(entries, text, 2)
    assert got[0] is None
    assert list(got[1]) == ["7", "3"]
    assert got[1]["7"] == {"logprob": -0.5, "rank": 1, "decoded_token": ""}
    assert got[1]["3"]["rank"] == 2
    assert list(got[2]) == ["9", "3", "4"]
    assert got[2]["9"] == {"logprob": -9999.0, "rank": 5, "decoded_token": ""}
    assert [v["rank"] for v in got[2].values()] == [5, 1, 2]
    assert list(vllm_prompt_logprobs(entries, text, 1)[2]) == ["9", "3"]
    assert vllm_prompt_logprobs(entries, text, None)[2].keys() == got[2].keys()
    assert vllm_prompt_logprobs(None, text, 2) is None
