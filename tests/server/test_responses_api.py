"""POST /v1/responses through the real `openai` SDK on the default model: plain,
streamed, continued with previous_response_id, a function tool round trip, a JSON
schema format; every event and body validated against the SDK's own types; GET and
DELETE of stored responses; what the API has and kvserve does not is a 400 and the
engine keeps serving."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.server.conftest import SMOL
from tests.support.http import assert_error

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 20}}}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True,
          "description": "Weather in a city"}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def typed(body: dict) -> Response:
    """The body, validated (not just read) as the SDK's Response."""
    return Response.model_validate(body)


def stream_events(url: str, body: dict) -> list:
    raw = httpx.post(f"{url}/v1/responses", json={**body, "stream": True}, timeout=120)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith(
        "text/event-stream")
    events = []
    for block in raw.text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = EVENTS.validate_python(json.loads(data[6:]))
        assert event.type == name[7:]
        events.append(event)
    return events


def test_plain_response(smol_client):
    out = smol_client.responses.create(model=SMOL, input="Say hello in French.",
                                       instructions="Answer in one short sentence.",
                                       max_output_tokens=40, temperature=0)
    body = typed(out.model_dump(mode="json", exclude_unset=True))
    assert body.id.startswith("resp_") and body.object == "response"
    assert body.status in ("completed", "incomplete") and out.output_text
    assert [o.type for o in body.output] == ["message"]
    assert body.instructions == "Answer in one short sentence."
    assert body.usage.input_tokens > 0
    assert body.usage.total_tokens == body.usage.input_tokens + body.usage.output_tokens
    if body.status == "incomplete":
        assert body.incomplete_details.reason == "max_output_tokens"
        assert body.usage.output_tokens == 40


def test_a_cut_response_is_incomplete(smol_url):
    body = typed(httpx.post(f"{smol_url}/v1/responses", json={
        "model": SMOL, "input": "Tell me a long story.", "max_output_tokens": 5},
        timeout=60).json())
    assert body.status == "incomplete" and body.incomplete_details.reason == "max_output_tokens"
    assert body.output[0].status == "incomplete" and body.usage.output_tokens == 5


def test_streamed_events_are_the_sdks_and_end_in_the_whole_response(smol_url):
    request = {"model": SMOL, "input": "Name three colours.", "max_output_tokens": 48,
               "temperature": 0}
    events = stream_events(smol_url, request)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and set(kinds[4:4 + len(deltas)]) == {"response.output_text.delta"}
    assert kinds[4 + len(deltas):] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", events[-1].type]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(d.delta for d in deltas)
    assert final.output[0].content[0].text == text == events[-4].text
    assert {d.item_id for d in deltas} == {final.output[0].id}
    # the same request, not streamed (greedy): the same text
    whole = httpx.post(f"{smol_url}/v1/responses", json=request, timeout=60).json()
    assert typed(whole).output[0].content[0].text == text


def test_the_sdks_stream_helper_reads_it(smol_client):
    with smol_client.responses.stream(model=SMOL, input="Say yes.", temperature=0,
                                      max_output_tokens=200) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(texts)


def test_previous_response_id_continues_the_conversation(smol_client, smol_url):
    first = smol_client.responses.create(model=SMOL, input="My name is Ada.",
                                         max_output_tokens=16, temperature=0)
    second = smol_client.responses.create(model=SMOL, input="What is my name?",
                                          previous_response_id=first.id,
                                          max_output_tokens=16, temperature=0)
    assert second.previous_response_id == first.id
    # the continuation's prompt holds the first turn (input and output) and the new one
    alone = smol_client.responses.create(model=SMOL, input="What is my name?",
                                         max_output_tokens=16, temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    chat = smol_client.chat.completions.create(
        model=SMOL, max_tokens=16, temperature=0, messages=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_a_function_tool_round_trip(smol_client):
    ask = smol_client.responses.create(model=SMOL, input="What is the weather in Paris?",
                                       tools=TOOLS, tool_choice="required",
                                       max_output_tokens=80, extra_body={"seed": 1})
    calls = [o for o in ask.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    answer = smol_client.responses.create(
        model=SMOL, previous_response_id=ask.id, tools=TOOLS, tool_choice="none",
        max_output_tokens=32, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "18 degrees and sunny"}])
    assert answer.status in ("completed", "incomplete") and answer.output_text
    assert [o.type for o in answer.output] == ["message"]
    # the same round trip sent whole as input items, without the store
    whole = smol_client.responses.create(
        model=SMOL, tools=TOOLS, tool_choice="none", max_output_tokens=32, temperature=0,
        store=False, input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id,
             "output": "18 degrees and sunny"}])
    assert whole.output_text == answer.output_text


def test_a_named_function_streams_its_arguments(smol_url):
    events = stream_events(smol_url, {
        "model": SMOL, "input": "Weather in Oslo?", "tools": TOOLS, "seed": 2,
        "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60})
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [a.item.type for a in added] == ["function_call"]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == deltas and done.name == "get_weather"
    jsonschema.validate(json.loads(deltas), WEATHER)
    assert events[-1].type == "response.completed"


@pytest.mark.parametrize("seed", range(3))
def test_a_json_schema_format_holds(smol_client, seed):
    out = smol_client.responses.create(
        model=SMOL, input="Invent a person.", extra_body={"seed": seed}, max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), PERSON)


def test_stored_responses_get_and_delete(smol_url):
    made = httpx.post(f"{smol_url}/v1/responses", json={
        "model": SMOL, "input": "Hi", "max_output_tokens": 4}, timeout=60).json()
    got = httpx.get(f"{smol_url}/v1/responses/{made['id']}", timeout=10)
    assert got.status_code == 200 and got.json() == made
    gone = httpx.delete(f"{smol_url}/v1/responses/{made['id']}", timeout=10)
    assert gone.json() == {"id": made["id"], "object": "response", "deleted": True}
    assert_error(httpx.get(f"{smol_url}/v1/responses/{made['id']}", timeout=10), 404,
                 "response_id")
    assert_error(httpx.delete(f"{smol_url}/v1/responses/{made['id']}", timeout=10), 404)
    unstored = httpx.post(f"{smol_url}/v1/responses", json={
        "model": SMOL, "input": "Hi", "max_output_tokens": 4, "store": False},
        timeout=60).json()
    assert_error(httpx.get(f"{smol_url}/v1/responses/{unstored['id']}", timeout=10), 404)


BAD = [
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, 400, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
    ({"background": True}, 400, "background"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"include": ["file_search_call.results"]}, 400, "include"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, 400, "input[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0]"),
    ({"input": []}, 400, "input"),
    ({"previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
     400, "text.format"),
    ({"text": {"format": {"type": "grammar"}}}, 400, "text.format"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"max_output_tokens": 0}, 400, None),
    ({"temperature": 3}, 400, None),
    ({"model": "nope"}, 404, "model"),
    ({"input": "x" * 200_000}, 400, "input"),
]


@pytest.mark.parametrize("extra,status,param", BAD, ids=[str(b[0])[:60] for b in BAD])
def test_what_kvserve_lacks_is_a_clear_error_and_serving_goes_on(smol_url, extra, status,
                                                                 param):
    body = {"model": SMOL, "input": "Hello", "max_output_tokens": 4, **extra}
    r = httpx.post(f"{smol_url}/v1/responses", json=body, timeout=60)
    err = assert_error(r, status) if param is None else assert_error(r, status, param)
    assert err["message"]
    ok = httpx.post(f"{smol_url}/v1/responses", json={
        "model": SMOL, "input": "Hello", "max_output_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2
