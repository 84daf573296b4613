"""POST /v1/messages and /v1/messages/count_tokens through Anthropic's own SDK, on a
tiny random-weight llama (ChatML template) served with an API key: a plain message
(greedy: the text /v1/chat/completions gives for the same prompt), streamed (the
SDK's stream helper, and every raw event as the SDK's own type, in Anthropic's
order), a tool round trip held to valid calls by the chat route's grammars, token
counts, stop sequences, max_tokens and the context's end; bad input as Anthropic's
errors with Anthropic's status codes, the key from x-api-key or Bearer, and the
request caps chat has."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.support.anthropic_sse import assert_anthropic_error, message, typed_events
from tests.support.http import assert_error, wait_idle
from tests.support.server import running_server

MODEL = "tiny-anthropic"
KEY = "sk-test-key"
OTHER_KEY = "sk-other-key"
CONTEXT = 512
BODY_LIMIT = 256 << 10
TIMEOUT = 120.0
SYSTEM = "Paged attention stores keys"
ASK = [{"role": "user", "content": "The capital of France is"}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
# Letters only: the grammars let raw control characters into a string, which the
# writer escapes as they stream and chat escapes by writing the whole call again
# (server/tools.py), not byte for byte alike; the round trip compares the two.
PLAIN_WEATHER = {**WEATHER, "properties": {"city": {"type": "string",
                                                    "pattern": "^[A-Za-z ]{1,12}$"}}}


def tools(schema: dict) -> list[dict]:
    return [{"name": "get_weather", "description": "Weather in a city", "input_schema": schema}]


def chat_tools(schema: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_weather",
                                              "description": "Weather in a city",
                                              "parameters": schema}}]


TOOLS = tools(WEATHER)
# Anthropic's newest SDKs no longer type temperature: sent as a plain body field.
GREEDY = {"extra_body": {"temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def served(tiny_engine_factory):
    engine = tiny_engine_factory("llama", max_model_len=CONTEXT)
    config = ServerConfig(api_keys=[KEY, OTHER_KEY], max_request_body_bytes=BODY_LIMIT)
    with running_server(build_app(AsyncEngine(engine), [MODEL], config=config)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(url):
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0,
                             timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def chat(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                       timeout=TIMEOUT) as c:
        yield c


def post(url: str, body: dict, path: str = "/v1/messages",
         headers: dict | None = None) -> httpx.Response:
    body = {"model": MODEL, **body}
    return httpx.post(url + path, json=body, timeout=TIMEOUT,
                      headers={"x-api-key": KEY} if headers is None else headers)


def text_of(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_a_message_is_the_chat_routes_answer_to_the_same_prompt(client, chat, url):
    msg = client.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=12,
                                 **GREEDY)
    body = message(post(url, {"system": SYSTEM, "messages": ASK, "max_tokens": 12,
                              "temperature": 0, "ignore_eos": True}))
    assert text_of(body) == text_of(msg) and msg.stop_reason == "max_tokens"
    assert body.id.startswith("msg_") and body.type == "message" and body.role == "assistant"
    assert body.model == MODEL and [b.type for b in body.content] == ["text"]
    assert body.stop_reason == "max_tokens" and body.stop_sequence is None
    expected = chat.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": SYSTEM}, *ASK])
    assert text_of(body) == expected.choices[0].message.content
    assert body.usage.output_tokens == 12 == expected.usage.completion_tokens
    assert (body.usage.input_tokens + body.usage.cache_read_input_tokens
            == expected.usage.prompt_tokens)
    assert body.usage.cache_creation_input_tokens == 0


def test_system_as_text_blocks_and_cache_control_are_read(client):
    plain = client.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=6,
                                   **GREEDY)
    blocks = client.messages.create(
        model=MODEL, max_tokens=6, **GREEDY,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": ASK[0]["content"],
             "cache_control": {"type": "ephemeral"}}]}])
    assert text_of(blocks) == text_of(plain)


def test_a_prefilled_assistant_turn_is_continued(client, chat):
    messages = [*ASK, {"role": "assistant", "content": "Paris"}]
    msg = client.messages.create(model=MODEL, messages=messages, max_tokens=6, **GREEDY)
    expected = chat.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "add_generation_prompt": False,
                    "continue_final_message": True})
    assert text_of(msg) == expected.choices[0].message.content


def test_the_sdks_stream_helper_reads_the_stream(client):
    whole = client.messages.create(model=MODEL, messages=ASK, max_tokens=10, **GREEDY)
    with client.messages.stream(model=MODEL, messages=ASK, max_tokens=10, **GREEDY) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == text_of(final) == text_of(whole) and len(texts) > 1
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_every_streamed_event_is_the_sdks_in_anthropics_order(client, url):
    typed = list(client.messages.create(model=MODEL, messages=ASK, max_tokens=8,
                                        stream=True, **GREEDY))
    kinds = [e.type for e in typed]
    deltas = kinds.count("content_block_delta")
    assert deltas > 1
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    assert typed[0].message.content == [] and typed[0].message.stop_reason is None
    assert typed[1].content_block.type == "text" and typed[1].index == 0
    assert {e.delta.type for e in typed[2:-3]} == {"text_delta"}
    assert typed[-2].delta.stop_reason == "max_tokens" and typed[-2].usage.output_tokens == 8
    # the raw stream: its framing, a ping after message_start, the same events
    raw = post(url, {"messages": ASK, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                     "stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith(
        "text/event-stream")
    events = typed_events(raw.content)
    assert [e["type"] if isinstance(e, dict) else e.type for e in events] == [
        kinds[0], "ping", *kinds[1:]]
    text = "".join(e.delta.text for e in events
                   if not isinstance(e, dict) and e.type == "content_block_delta")
    assert text == "".join(e.delta.text for e in typed[2:-3])


def test_stop_sequences_end_the_message_with_stop_reason_stop_sequence(client):
    free = text_of(client.messages.create(model=MODEL, messages=ASK, max_tokens=16,
                                          **GREEDY))
    start = next(i for i in range(2, len(free) - 2) if free[i:i + 2].isprintable()
                 and free[i:i + 2].strip() == free[i:i + 2])
    stop = free[start:start + 2]
    kw = dict(model=MODEL, messages=ASK, max_tokens=16, stop_sequences=["@@never@@", stop],
              **GREEDY)
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert text_of(msg) == free[:free.index(stop)]
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert text_of(final) == text_of(msg)


def test_max_tokens_past_the_context_stops_at_its_end(client, served):
    count = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    msg = client.messages.create(model=MODEL, messages=ASK, max_tokens=100_000, **GREEDY)
    assert msg.stop_reason == "model_context_window_exceeded"
    assert msg.usage.output_tokens == CONTEXT - count
    assert wait_idle(served[1])


def test_count_tokens_is_the_prompt_messages_runs(client, chat):
    conversation = [*ASK, {"role": "assistant", "content": "Paris."},
                    {"role": "user", "content": "And Italy?"}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=conversation,
                                           tools=TOOLS)
    assert counted.input_tokens > 0
    msg = client.messages.create(model=MODEL, system=SYSTEM, messages=conversation,
                                 tools=TOOLS, tool_choice={"type": "none"}, max_tokens=2,
                                 **GREEDY)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted.input_tokens
    expected = chat.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, tool_choice="none",
        tools=chat_tools(WEATHER),
        messages=[{"role": "system", "content": SYSTEM}, *conversation])
    assert expected.usage.prompt_tokens == counted.input_tokens


def _tool_uses(msg, schema: dict = WEATHER) -> list:
    calls = [b for b in msg.content if b.type == "tool_use"]
    for call in calls:
        assert call.name == "get_weather" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, schema)
    return calls


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
@pytest.mark.parametrize("seed", [3, 4])
def test_a_tool_round_trip(client, chat, choice, seed):
    ask = client.messages.create(model=MODEL, messages=[
        {"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools(PLAIN_WEATHER), tool_choice=choice, max_tokens=80,
        extra_body={"temperature": 1.0, "seed": seed})
    (call,) = _tool_uses(ask, PLAIN_WEATHER)
    assert ask.stop_reason == "tool_use"
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": ask.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "18 degrees and sunny"}]}]
    answer = client.messages.create(model=MODEL, messages=history, tools=tools(PLAIN_WEATHER),
                                    tool_choice={"type": "none"}, max_tokens=8, **GREEDY)
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason == "max_tokens"
    # the same turn through chat: the same prompt, the same answer
    expected = chat.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, tool_choice="none",
        extra_body={"ignore_eos": True}, tools=chat_tools(PLAIN_WEATHER),
        messages=[history[0],
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.id, "type": "function", "function": {
                          "name": "get_weather", "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id,
                   "content": "18 degrees and sunny"}])
    assert text_of(answer) == expected.choices[0].message.content
    assert (answer.usage.input_tokens + answer.usage.cache_read_input_tokens
            == expected.usage.prompt_tokens)


def test_a_streamed_tool_call_comes_as_input_json_deltas(client, url):
    kw = dict(messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
              tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=80)
    seeded = {"temperature": 1.0, "seed": 5}
    with client.messages.stream(model=MODEL, **kw, extra_body=seeded) as s:
        final = s.get_final_message()
    (call,) = _tool_uses(final)
    assert final.stop_reason == "tool_use"
    raw = typed_events(post(url, {**kw, **seeded, "stream": True}).content)
    start = next(e for e in raw if not isinstance(e, dict) and e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    parts = [e.delta.partial_json for e in raw if not isinstance(e, dict)
             and e.type == "content_block_delta"]
    assert {e.delta.type for e in raw if not isinstance(e, dict)
            and e.type == "content_block_delta"} == {"input_json_delta"}
    assert json.loads("".join(parts)) == call.input
    whole = client.messages.create(model=MODEL, **kw, extra_body=seeded)
    assert _tool_uses(whole)[0].input == call.input


def test_the_key_is_taken_from_x_api_key_or_bearer(url, client):
    bearer = anthropic.Anthropic(base_url=url, api_key=None, auth_token=OTHER_KEY,
                                 max_retries=0, timeout=TIMEOUT)
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    # the OpenAI routes take x-api-key too: the same key, the same rules
    r = httpx.get(url + "/v1/models", headers={"x-api-key": KEY}, timeout=TIMEOUT)
    assert r.status_code == 200
    bad = anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model=MODEL, messages=ASK, max_tokens=2)
    assert err.value.status_code == 401 and err.value.type == "authentication_error"
    assert_anthropic_error(post(url, {"messages": ASK, "max_tokens": 2}, headers={}), 401,
                           "x-api-key")
    assert_anthropic_error(post(url, {"messages": ASK, "max_tokens": 2}, headers={
        "x-api-key": KEY, "Authorization": f"Bearer {OTHER_KEY}"}), 401, "two different")
    assert_anthropic_error(post(url, {"messages": ASK}, path="/v1/messages/count_tokens",
                                headers={"x-api-key": "nope"}), 401)
    # OpenAI's routes answer in OpenAI's shape still
    err = assert_error(httpx.get(url + "/v1/models", headers={"x-api-key": "nope"}), 401)
    assert err["type"] == "authentication_error"


MSG = {"messages": ASK, "max_tokens": 4}


@pytest.mark.parametrize("body,contains", [
    ({"messages": ASK}, "max_tokens"),  # missing
    ({**MSG, "max_tokens": 0}, "max_tokens"),
    ({**MSG, "messages": []}, "messages"),
    ({**MSG, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({**MSG, "messages": [{"role": "user"}]}, "messages.0.content"),
    ({**MSG, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]}, "'image'"),
    ({**MSG, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]}, "'document'"),
    ({**MSG, "temperature": 1.5}, "temperature"),
    ({**MSG, "top_k": -1}, "top_k"),
    ({**MSG, "stop_sequences": "END"}, "stop_sequences"),
    ({**MSG, "frobnicate": True}, "frobnicate"),
    ({**MSG, "container": "container_1"}, "container"),
    ({**MSG, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "MCP"),
    ({**MSG, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format"),
    ({**MSG, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tools"),
    ({**MSG, "tools": [{"name": "f"}]}, "input_schema"),
    ({**MSG, "tool_choice": {"type": "any"}}, "tool_choice"),  # no tools
    ({**MSG, "tools": TOOLS, "tool_choice": {"type": "required"}}, "tool_choice.type"),
    ({**MSG, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({**MSG, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({**MSG, "stop_sequences": ["s"] * 65}, "stop_sequences"),  # past --max-stop-strings
    ({**MSG, "tools": [{"name": f"f{i}", "input_schema": {"type": "object"}}
                       for i in range(129)]}, "tools"),  # past --max-tools
    ({**MSG, "messages": [{"role": "user", "content": "x " * 2000}]}, "context"),
    ({**MSG, "logit_bias": {"nope": 1}}, "logit_bias"),
])
def test_bad_input_is_anthropics_400(url, body, contains):
    assert_anthropic_error(post(url, body), 400, contains)


def test_the_sdk_reads_the_errors(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}], max_tokens=4)
    assert err.value.status_code == 400 and err.value.type == "invalid_request_error"
    assert err.value.body["type"] == "error"
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-nope", messages=ASK, max_tokens=4)
    assert err.value.type == "not_found_error" and "claude-nope" in err.value.body[
        "error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[])


def test_a_body_past_the_limit_is_request_too_large(url):
    big = {"messages": [{"role": "user", "content": "x" * (BODY_LIMIT + 1)}], "max_tokens": 2}
    assert_anthropic_error(post(url, big), 413, "--max-request-body-bytes")


def test_an_unknown_route_names_itself_in_each_apis_shape(url):
    headers = {"x-api-key": KEY}
    err = assert_error(httpx.post(url + "/v1/foo", json={}, headers=headers), 404)
    assert err["message"] == "no route POST /v1/foo" and err["type"] == "not_found_error"
    err = assert_error(httpx.get(url + "/v1/chat/nope", headers=headers), 404)
    assert err["message"] == "no route GET /v1/chat/nope"
    assert_anthropic_error(httpx.post(url + "/v1/messages/nope", json={}, headers=headers),
                           404, "no route POST /v1/messages/nope")
    assert_anthropic_error(httpx.get(url + "/v1/messages", headers=headers), 405)


def test_openai_routes_keep_openais_error_shape(url):
    r = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": KEY},
                   json={"model": MODEL, "messages": []}, timeout=TIMEOUT)
    assert_error(r, 400, param="messages")


def test_the_openapi_schema_says_the_errors_are_anthropics(url):
    schema = httpx.get(url + "/openapi.json", timeout=TIMEOUT).json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "500", "529"} <= set(responses)
        assert "503" not in responses and "422" not in responses
        for code, response in responses.items():
            if code != "200":
                assert response["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/AnthropicErrorResponse"}, code
    assert "text/event-stream" in schema["paths"]["/v1/messages"]["post"]["responses"][
        "200"]["content"]
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}


def test_nothing_is_left_running(served):
    assert wait_idle(served[1])
