"""An agent's loop over /v1/messages on the default model, as a Claude-Code-style
client runs it through Anthropic's SDK: streamed turns, the model's tool_use blocks
run and answered with tool_result blocks, until it answers in text. The first turn
must call a tool (tool_choice any), the next may (auto, the format's grammar holding
a begun call to a valid one); every call's input is valid for its tool's schema, and
the conversation ends with an answer."""
from __future__ import annotations

import anthropic
import jsonschema
import pytest

from tests.server.conftest import SMOL

TOOLS = [
    {"name": "get_weather", "description": "The current weather in a city.",
     "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                      "properties": {"city": {"type": "string",
                                              "pattern": "^[A-Za-z ]{1,20}$"}}}},
    {"name": "add", "description": "The sum of two integers.",
     "input_schema": {"type": "object", "additionalProperties": False,
                      "required": ["a", "b"],
                      "properties": {"a": {"type": "integer", "minimum": -1000,
                                           "maximum": 1000},
                                     "b": {"type": "integer", "minimum": -1000,
                                           "maximum": 1000}}}}]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
SYSTEM = [{"type": "text", "text": "You are a helpful assistant. Use the tools to answer.",
           "cache_control": {"type": "ephemeral"}}]
MAX_TOOL_TURNS = 3


def run_tool(name: str, arguments: dict) -> str:
    if name == "get_weather":
        return f"It is 18 degrees and sunny in {arguments['city']}."
    return str(arguments["a"] + arguments["b"])


@pytest.fixture(scope="module")
def client(smol_url):
    with anthropic.Anthropic(base_url=smol_url, api_key="none", max_retries=0,
                             timeout=300) as c:
        yield c


@pytest.mark.slow
def test_an_agent_loop_with_tools_completes(client):
    conversation = [{"role": "user", "content": "What is the weather in Paris?"}]
    seen_ids = set()
    for turn in range(MAX_TOOL_TURNS + 1):
        choice = ({"type": "any"} if turn == 0 else {"type": "none"}
                  if turn == MAX_TOOL_TURNS else {"type": "auto"})
        before = list(conversation)
        with client.messages.stream(model=SMOL, system=SYSTEM, messages=conversation,
                                    tools=TOOLS, tool_choice=choice, max_tokens=160,
                                    extra_body={"temperature": 0}) as stream:
            streamed = "".join(stream.text_stream)
            reply = stream.get_final_message()
        assert streamed == "".join(b.text for b in reply.content if b.type == "text")
        calls = [b for b in reply.content if b.type == "tool_use"]
        if turn == 0:
            assert calls and reply.stop_reason == "tool_use"
        for call in calls:
            assert call.id.startswith("toolu_") and call.id not in seen_ids
            seen_ids.add(call.id)
            jsonschema.validate(call.input, SCHEMAS[call.name])
        conversation.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            break
        conversation.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id,
             "content": run_tool(call.name, call.input)} for call in calls]})
    assert reply.stop_reason in ("end_turn", "max_tokens"), reply.stop_reason
    assert not calls and streamed.strip()  # it ended with an answer
    # the last turn's prompt is the conversation before it, counted the same way
    counted = client.messages.count_tokens(model=SMOL, system=SYSTEM, messages=before,
                                           tools=TOOLS, tool_choice=choice)
    assert counted.input_tokens == (reply.usage.input_tokens
                                    + reply.usage.cache_read_input_tokens)
    assert reply.usage.cache_read_input_tokens > 0  # the earlier turns' prefix, cached
