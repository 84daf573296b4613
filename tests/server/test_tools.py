"""Tool calls through the real `openai` SDK on the default model: the forced kinds
(`tool_choice` "required" or a named function, enforced by grammar: valid arguments
on a model whose chat template knows no tools), "none", and "auto" in each family's
format (the parsers alone are in test_tool_parsers.py)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from tests.server.conftest import SMOL
from tests.support.http import assert_error

MODEL = SMOL
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "Weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                           "description": "Time in a zone"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    return args


@pytest.mark.parametrize("seed", range(3))
def test_a_named_function_is_called_with_valid_arguments(smol_client, seed):
    r = smol_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice=NAMED, temperature=1.0, seed=seed,
                                       max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    valid(call)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_one_of_the_tools(smol_client, parallel):
    r = smol_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", temperature=1.0, seed=4,
                                       max_tokens=120, parallel_tool_calls=parallel)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        valid(call)


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_streamed_tool_call_deltas_reassemble(smol_client, choice):
    stream = smol_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice=choice, temperature=1.0, seed=2,
                                            max_tokens=120, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    assert call["id"] is None  # the id and the name come once, first
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_round_trip_call_result_answer(smol_client):
    r = smol_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice=NAMED, temperature=0.0, max_tokens=60)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = smol_client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                            tool_choice="none", temperature=0.0,
                                            max_tokens=30)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function",
                                      "function": {"name": "nope"}}}, "tool_choice"),
    # auto with a template that writes calls in a format none of the parsers reads
    ({"tools": TOOLS, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"
      "{% if tools %}{{ tools | tojson }}{% endif %}"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nonsense"}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "nope"}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": NAMED,
      "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(smol_url, body, param):
    with httpx.Client(base_url=smol_url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                    "max_tokens": 5, **body})
    assert_error(r, 400, param)


def _family_template(call: str) -> str:
    """ChatML turns (what the default model knows) with a family's call markup:
    `call` renders `c`, an earlier call."""
    return ("{%- if tools %}<|im_start|>system\nYou can call these functions: "
            "{{ tools | tojson }}<|im_end|>\n{% endif %}{%- for m in messages %}"
            "<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
            + call + "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
            "{% endfor %}<|im_start|>assistant\n")


ARGS = "{{ c.function.arguments }}"
FAMILY_TEMPLATES = {  # read off by --tool-call-parser auto (server/tool_formats.py)
    "hermes": None,  # the default model's own template: told the format
    "llama3_json": _family_template(
        '{# ipython #}{"name": "{{ c.function.name }}", "parameters": ' + ARGS + "}"),
    "mistral": _family_template(
        '[TOOL_CALLS][{"name": "{{ c.function.name }}", "arguments": ' + ARGS + "}]"),
}


def _asked_after_two_calls(city: str) -> list[dict]:
    """Two earlier weather questions answered by calls: a 135M model copies them."""
    history = []
    for i, earlier in enumerate(["Paris", "Berlin"]):
        args = json.dumps({"city": earlier, "unit": "celsius"})
        history += [
            {"role": "user", "content": f"What is the weather in {earlier}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny, 21 C"},
            {"role": "assistant", "content": f"It is sunny in {earlier}, 21 C."}]
    return history + [{"role": "user", "content": f"What is the weather in {city}?"}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family", FAMILY_TEMPLATES)
def test_auto_in_each_family_format_parses_the_call_the_model_writes(smol_client, family,
                                                                     stream):
    """Each parser end to end: the chat template decides the format, the model (shown
    two calls in it) writes a third, and it comes back as a tool call, whole or as
    OpenAI's deltas, with no markup in the content."""
    template = FAMILY_TEMPLATES[family]
    kw = dict(model=MODEL, messages=_asked_after_two_calls("Rome"), tools=TOOLS,
              temperature=0.0, max_tokens=60,
              extra_body={"chat_template": template} if template else None)
    if stream:
        content, calls, finish = "", {}, None
        for chunk in smol_client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or ():
                    calls[d.index] = (d.function.name, d.function.arguments)
                finish = c.finish_reason or finish
        calls = list(calls.values())
    else:
        choice = smol_client.chat.completions.create(**kw).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls" and not content.strip()
    (name, arguments), = calls
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_lets_the_model_choose_and_whatever_it_writes_is_well_formed(smol_client,
                                                                          stream):
    """The default model's template knows no tools: it is told the Hermes format (the
    135M model answers in text; calls in that format are parsed in
    test_tool_parsers.py). Over several seeds, each answer is text with no markup,
    or calls with valid arguments (the grammar holds a begun call to the schema)."""
    def answer(seed):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0.7, seed=seed,
                  max_tokens=100)
        if not stream:
            choice = smol_client.chat.completions.create(**kw).choices[0]
            calls = [(c.function.name, c.function.arguments)
                     for c in choice.message.tool_calls or ()]
            return choice.message.content or "", calls, choice.finish_reason
        content, calls, finish = "", [], None
        for chunk in smol_client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += [(d.function.name, d.function.arguments)
                          for d in c.delta.tool_calls or ()]
                finish = c.finish_reason or finish
        return content, calls, finish

    with ThreadPoolExecutor(6) as pool:  # one batch
        answers = list(pool.map(answer, range(6)))
    outcomes = set()
    for content, calls, finish in answers:
        if finish == "length":
            continue  # cut short: whatever it was
        assert "<tool_call>" not in content and "</tool_call>" not in content
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert finish == ("tool_calls" if calls else "stop")
        outcomes.add(bool(calls))
    assert outcomes  # at least one answer was not cut short
