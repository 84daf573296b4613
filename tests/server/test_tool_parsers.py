"""Each family's tool-call format, parsed whole and streamed in any split of the text.
The outputs are written the way each family's models write calls, as their chat
templates show them (Qwen2.5 / Hermes 3, Llama 3.1-3.3, Mistral 7B v0.3 and the v11
tokenizers' Mistral Small 3.x); no such model's weights are on this machine."""
from __future__ import annotations

import json

import pytest

from kvserve.server.tool_formats import FORMATS, tool_format

WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {"zone": "CET"})

# (format, an output with text before two calls, characters of its markup)
TWO_CALLS = [
    ("hermes", 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
     '{"zone": "CET"}}\n</tool_call>', "<>"),
    ("llama3_json", 'Let me check. {"name": "get_weather", "parameters": {"city": '
     '"Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}', "{};"),
    ("mistral", 'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]', "[]{}"),
    ("mistral", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
     '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "[]{}"),
]
ONE_CALL = {  # a call alone, as most outputs are
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}
# an opening whose call is cut short (max_tokens), and one that is not a call
NOT_CALLS = {
    "hermes": ['a <tool_call>\n{"name": "get_weather", "argu',
               'a <tool_call>\n{"name": 5}\n</tool_call> b'],
    "llama3_json": ['a {"name": "get_weather", "parameters": {"ci',
                    'a {"name": "get_weather", "parameters": [1]} b'],
    "mistral": ['a [TOOL_CALLS][{"name": "get_weather", "argu',
                'a [TOOL_CALLS][{"nome": "get_weather"}] b'],
}


def parsed(fmt: str, text: str):
    content, calls = FORMATS[fmt].split(text)
    return content, [(name, json.loads(args)) for name, args in calls]


@pytest.mark.parametrize("fmt, text, markup", TWO_CALLS)
def test_text_before_two_calls(fmt, text, markup):
    content, calls = parsed(fmt, text)
    assert content.strip() == "Let me check."
    assert calls == [WEATHER, TIME]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_alone_and_text_alone(fmt):
    assert parsed(fmt, ONE_CALL[fmt]) == ("", [WEATHER])
    assert parsed(fmt, "Paris is sunny {today} [really] <b>") == (
        "Paris is sunny {today} [really] <b>", [])


@pytest.mark.parametrize("fmt", FORMATS)
def test_what_never_becomes_a_call_stays_text(fmt):
    for text in NOT_CALLS[fmt]:
        assert parsed(fmt, text) == (text, [])


def test_brackets_inside_argument_strings_do_not_end_a_call():
    text = '{"name": "search", "parameters": {"q": "a}b]{\\"c"}}'
    assert parsed("llama3_json", text) == ("", [("search", {"q": 'a}b]{"c'})])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, 1000])
@pytest.mark.parametrize("fmt, text, markup", TWO_CALLS)
def test_streamed_in_any_pieces_no_markup_leaks(fmt, text, markup, size):
    stream, content, calls = FORMATS[fmt].stream(), "", []
    for at in range(0, len(text), size):
        piece, done = stream.feed(text[at:at + size])
        assert not set(piece) & set(markup)  # no piece of the markup, ever
        content, calls = content + piece, calls + done
    content += stream.rest()
    assert (content, calls) == FORMATS[fmt].split(text)


@pytest.mark.parametrize("template, parser, expected", [
    ("{{ messages }}", "auto", "hermes"),  # knows no tools: told hermes
    ("{% if tools %}<tool_call>{% endif %}", "auto", "hermes"),  # Qwen2.5's
    ("{% if tools %}<|python_tag|>{% endif %}", "auto", "llama3_json"),  # Llama 3.1's
    ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "auto", "mistral"),
    ("{% if tools %}{{ tools }}{% endif %}", "auto", None),  # a format none reads
    ("{% if tools %}{{ tools }}{% endif %}", "llama3_json", "llama3_json"),  # the flag
])
def test_the_format_comes_from_the_flag_or_the_template(template, parser, expected):
    fmt = tool_format(parser, template)
    assert (fmt.name if fmt else None) == expected
