"""POST /tokenize (prompt or chat messages) and POST /detokenize, as vLLM serves them."""
from __future__ import annotations

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.chat_template import render_chat
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error
from tests.support.server import running_server

MODEL = "tiny"
TEXT = "Héllo wörld — the capital of France is Paris 🙂"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "The capital of France?"}]


@pytest.fixture(scope="module")
def served(tiny_engine_factory):
    aengine = AsyncEngine(tiny_engine_factory("llama"))
    with running_server(build_app(aengine, [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        yield http, aengine


def test_tokenize_a_prompt(served):
    http, aengine = served
    tok = aengine.tokenizer
    for special in (True, False):
        r = http.post("/tokenize", json={"model": MODEL, "prompt": TEXT,
                                         "add_special_tokens": special})
        assert r.status_code == 200, r.text
        ids = tok.encode(TEXT, add_special_tokens=special)
        assert r.json() == {"count": len(ids), "max_model_len": aengine.max_model_len,
                            "tokens": ids}


def test_token_strs_on_request(served):
    http, aengine = served
    body = http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert body["token_strs"] == aengine.tokenizer.convert_ids_to_tokens(body["tokens"])
    assert len(body["token_strs"]) == body["count"]


@pytest.mark.parametrize("gen_prompt,cont", [(True, False), (False, False), (False, True)])
def test_tokenize_messages(served, gen_prompt, cont):
    http, aengine = served
    msgs = MESSAGES + [{"role": "assistant", "content": "Par"}] if cont else MESSAGES
    r = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": gen_prompt,
                                     "continue_final_message": cont})
    assert r.status_code == 200, r.text
    ids = render_chat(aengine.tokenizer, msgs, gen_prompt, cont)
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids)


def test_messages_default_to_a_generation_prompt(served):
    http, aengine = served
    ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    text = aengine.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "Be brief." in text


@pytest.mark.parametrize("body,param", [
    ({"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt")])
def test_tokenize_bad_bodies_are_400(served, body, param):
    http, _ = served
    assert_error(http.post("/tokenize", json=body), 400, param=param)


def test_invalid_json_is_400(served):
    http, _ = served
    for path in ("/tokenize", "/detokenize"):
        r = http.post(path, content=b"{nope", headers={"content-type": "application/json"})
        assert_error(r, 400)


def test_detokenize_round_trip(served):
    http, _ = served
    ids = http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_detokenize_bad_ids_are_400(served):
    http, aengine = served
    for bad in (-1, aengine.vocab_size, 10**12):
        err = assert_error(http.post("/detokenize", json={"tokens": [1, bad]}), 400,
                           param="tokens")
        assert str(bad) in err["message"]
    assert_error(http.post("/detokenize", json={"tokens": ["a"]}), 400)


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "x"}),
                                       ("/tokenize", {"messages": MESSAGES}),
                                       ("/detokenize", {"tokens": [1]})])
def test_unknown_model_is_404(served, path, body):
    http, _ = served
    assert_error(http.post(path, json={**body, "model": "nope"}), 404, param="model",
                 code="model_not_found")


def test_what_cannot_fit_the_context_is_refused_as_generation_would(served):
    """The same length refusal as completions and chat, found without tokenizing a
    10 MiB body, and no more ids to detokenize than the context holds."""
    http, aengine = served
    huge = "word " * (2 * aengine.max_model_len * 8)
    assert_error(http.post("/tokenize", json={"prompt": huge}), 400, param="prompt")
    assert_error(http.post("/tokenize", json={"messages": [{"role": "user", "content": huge}]}),
                 400, param="messages")
    assert_error(http.post("/detokenize", json={"tokens": [1] * (aengine.max_model_len + 1)}),
                 400, param="tokens")
    assert http.post("/detokenize", json={"tokens": [1] * 8}).status_code == 200


def test_tokenizer_routes_never_hold_up_a_prompt(served, monkeypatch):
    """/tokenize runs on a thread (and tokenizer) of its own: while three slow ones
    run, a completion's prompt is tokenized at once."""
    import threading
    import time

    from kvserve.server import tokenize_api

    http, _ = served
    real = tokenize_api._tokenize
    monkeypatch.setattr(tokenize_api, "_tokenize",
                        lambda *args: time.sleep(2) or real(*args))
    slow = [threading.Thread(target=http.post, args=("/tokenize",),
                             kwargs={"json": {"prompt": TEXT}}) for _ in range(3)]
    for t in slow:
        t.start()
    time.sleep(0.3)  # the first holds the routes' thread, two wait behind it
    start = time.monotonic()
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": TEXT, "max_tokens": 1})
    took = time.monotonic() - start
    for t in slow:
        t.join()
    assert r.status_code == 200, r.text
    assert took < 1.5, f"the completion waited {took:.1f} s behind /tokenize"
