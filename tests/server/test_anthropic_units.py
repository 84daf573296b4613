"""server/anthropic/ without a server: the conversation in chat terms, the content
blocks and stream events (validated as the SDK's own types), the stop reasons, and
errors reshaped into Anthropic's shape and status codes."""
from __future__ import annotations

import json

import pytest
from anthropic.types import Message

from kvserve.server.anthropic.errors import reshaped
from kvserve.server.anthropic.inputs import (chat_messages, chat_tool_choice, chat_tools,
                                             is_prefill, system_messages, thinking_switch)
from kvserve.server.anthropic.output import MessageWriter, StringControls, stop_reason, usage
from kvserve.server.anthropic.protocol import InputMessage, MessagesRequest, refuse_extras
from kvserve.server.errors import APIError, error_body
from tests.support.anthropic_sse import EVENT_TYPES


def turns(*messages: dict) -> list[InputMessage]:
    return [InputMessage(**m) for m in messages]


def test_a_tool_round_trip_becomes_chats_tool_calls_and_tool_messages():
    history = turns(
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look.", "signature": "sig"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}, "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "And tomorrow?"}]})
    assert chat_messages(history) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "I should look.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": "And tomorrow?"}]


def test_consecutive_turns_of_a_role_are_one_and_text_blocks_are_joined():
    history = turns({"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "text", "text": "b"}]},
                    {"role": "user", "content": "c"},
                    {"role": "assistant", "content": "d"})
    chat = chat_messages(history)
    assert chat == [{"role": "user", "content": "a\nb\nc"},
                    {"role": "assistant", "content": "d"}]
    assert is_prefill(history, chat)  # ends with the assistant's words: continued
    assert system_messages([{"type": "text", "text": "s1", "cache_control": {}},
                            {"type": "text", "text": "s2"}]) == [
        {"role": "system", "content": "s1\ns2"}]
    assert system_messages("") == []


@pytest.mark.parametrize("content,fragment", [
    ([{"type": "image", "source": {"type": "base64", "data": "x"}}], "'image'"),
    ([{"type": "document", "source": {}}], "'document'"),
    ([{"type": "text"}], "string `text`"),
    ([{"type": "text", "text": "x", "extra": 1}], "extra"),
    (["plain string"], "an object with a `type`"),
    ([{"type": "tool_result", "content": "x"}], "tool_use_id"),
    ([{"type": "tool_result", "tool_use_id": "t",
       "content": [{"type": "image", "source": {}}]}], "'image'"),
])
def test_blocks_kvserve_cannot_give_the_model_are_400s(content, fragment):
    with pytest.raises(APIError) as err:
        chat_messages(turns({"role": "user", "content": content}))
    assert err.value.status == 400 and fragment in err.value.message
    assert err.value.message.startswith("messages.0.content")


def test_a_last_assistant_turn_with_tool_calls_wants_their_results():
    history = turns({"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]})
    with pytest.raises(APIError, match="tool_result"):
        is_prefill(history, chat_messages(history))


def test_tools_and_tool_choice_in_chat_terms():
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    assert chat_tools([{"name": "search", "description": "d", "input_schema": schema,
                        "cache_control": {"type": "ephemeral"}}]) == [
        {"type": "function", "function": {"name": "search", "parameters": schema,
                                          "description": "d"}}]
    assert chat_tool_choice({"type": "auto"}) == ("auto", None)
    assert chat_tool_choice({"type": "any", "disable_parallel_tool_use": True}) == (
        "required", False)
    assert chat_tool_choice({"type": "tool", "name": "search"}) == (
        {"type": "function", "function": {"name": "search"}}, None)
    assert chat_tool_choice({"type": "none"}) == ("none", None)
    for bad in ({"type": "required"}, {"type": "tool"}, {"type": "auto", "name": "x"}):
        with pytest.raises(APIError):
            chat_tool_choice(bad)
    for bad in ([{"type": "web_search_20250305", "name": "web_search"}],
                [{"name": "f"}], [{"name": "f", "input_schema": {}, "defer_loading": True}]):
        with pytest.raises(APIError):
            chat_tools(bad)


def test_thinking_turns_the_templates_switch():
    assert thinking_switch(None) == (None, True)
    assert thinking_switch({"type": "enabled", "budget_tokens": 2048}) == (True, True)
    assert thinking_switch({"type": "adaptive", "display": "omitted"}) == (True, False)
    assert thinking_switch({"type": "disabled"}) == (False, True)
    for bad in ({"type": "enabled"}, {"type": "on"}, {"type": "enabled", "budget_tokens": 0},
                {"type": "disabled", "budget_tokens": 5}):
        with pytest.raises(APIError):
            thinking_switch(bad)


def test_unknown_and_hosted_fields_are_refused_hints_pass():
    base = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    refuse_extras(MessagesRequest(**base, seed=1, ignore_eos=True, inference_geo="us",
                                  cache_control={"type": "ephemeral"}, container=None))
    for extra, fragment in [({"container": "c1"}, "containers"),
                            ({"mcp_servers": [{"url": "u"}]}, "MCP"),
                            ({"frobnicate": 1}, "`frobnicate`"),
                            ({"n": 2}, "`n`"),
                            ({"output_config": {"format": {"type": "json_schema"}}},
                             "output_config.format")]:
        with pytest.raises(APIError) as err:
            refuse_extras(MessagesRequest(**base, **extra))
        assert err.value.status == 400 and fragment in err.value.message


def writer_run(show_thinking: bool = True):
    writer = MessageWriter("msg_1", "m", 10, show_thinking)
    events = writer.start()
    for delta in ({"role": "assistant", "content": ""}, {"reasoning_content": "think "},
                  {"reasoning_content": "more"}, {"content": "Hello"}, {"content": " there"},
                  {"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                                   "function": {"name": "f", "arguments": "{\"a\":"}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
                  {"tool_calls": [{"index": 1, "id": "call_def", "type": "function",
                                   "function": {"name": "g", "arguments": "{}"}}]}):
        events += writer.delta(delta)
    events += writer.finish("tool_use", None, usage(10, 7, 4))
    return writer, events


def test_the_writers_events_are_the_sdks_and_add_up_to_its_body():
    writer, events = writer_run()
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "ping",
                     "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    for e in events:
        if e["type"] != "ping":
            EVENT_TYPES[e["type"]].model_validate(e)
    body = Message.model_validate(writer.body())
    assert [b.type for b in body.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert body.content[0].thinking == "think more" and body.content[1].text == "Hello there"
    assert body.content[2].input == {"a": 1} and body.content[2].id == "toolu_abc"
    assert body.content[3].input == {} and body.stop_reason == "tool_use"
    assert body.usage.input_tokens == 6 and body.usage.cache_read_input_tokens == 4
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    assert starts == [0, 1, 2, 3]
    # message_start's message has no content yet and no stop reason
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None


def test_omitted_thinking_keeps_the_block_without_its_text():
    writer, events = writer_run(show_thinking=False)
    assert not any(e.get("delta", {}).get("type") == "thinking_delta" for e in events)
    assert writer.body()["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}


@pytest.mark.parametrize("finish,matched,past,expected", [
    ("stop", None, False, ("end_turn", None)),
    ("stop", 2, False, ("end_turn", None)),  # a stop token id, not a sequence
    ("stop", "END", False, ("stop_sequence", "END")),
    ("tool_calls", None, False, ("tool_use", None)),
    ("length", None, False, ("max_tokens", None)),
    ("length", None, True, ("model_context_window_exceeded", None)),
    ("abort", None, False, ("max_tokens", None)),
])
def test_stop_reasons(finish, matched, past, expected):
    assert stop_reason(finish, matched, ["END"], past) == expected


@pytest.mark.parametrize("status,param,expected_status,expected_type", [
    (400, "stop", 400, "invalid_request_error"), (401, None, 401, "authentication_error"),
    (404, "model", 404, "not_found_error"), (413, "body", 413, "request_too_large"),
    (429, None, 429, "rate_limit_error"), (500, None, 500, "api_error"),
    (503, None, 529, "overloaded_error")])
def test_openai_errors_are_reshaped(status, param, expected_status, expected_type):
    raw = json.dumps(error_body(status, "it went wrong", param)).encode()
    got_status, body = reshaped(status, raw)
    assert got_status == expected_status
    prefix = {"stop": "stop_sequences: ", "model": "model: ", "body": "body: "}.get(param, "")
    assert body == {"type": "error", "error": {"type": expected_type,
                                               "message": prefix + "it went wrong"}}
    assert reshaped(500, b"not json") == (500, {"type": "error", "error": {
        "type": "api_error", "message": "Internal Server Error"}})


def test_raw_control_characters_in_a_calls_strings_are_escaped_as_they_stream():
    raw = '{"city": "Pa\x01ris\\"\x02", "n":\n 1}'  # \x01 and \x02 inside strings
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    escaper = StringControls()
    fixed = "".join(escaper.feed(raw[i:i + 3]) for i in range(0, len(raw), 3))
    assert json.loads(fixed) == json.loads(raw, strict=False)
    assert "\n" in fixed  # whitespace between tokens is left as it is
