"""Tool calls' arguments are valid JSON for strict parsers, even when the grammar let
a raw control character into one of their strings (server/tools.py)."""
import json

from kvserve.server.tools import ToolPlan, escaped_controls


def test_raw_control_characters_come_back_escaped():
    raw = '{"path": "a\x01b\tc"}'
    fixed = escaped_controls(raw)
    assert json.loads(fixed) == {"path": "a\x01b\tc"}  # strict: no raw controls left
    assert "\x01" not in fixed


def test_valid_and_unparseable_arguments_are_left_byte_for_byte():
    for text in ('{"a":1,  "b": [2]}', '{"a": "cut sh'):
        assert escaped_controls(text) == text


def test_named_and_required_calls_parse_strictly():
    named = ToolPlan(mode="named", tools=[], name="f")
    _, calls = named.read('{"q": "x\x02y"}')
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "x\x02y"}
    required = ToolPlan(mode="required", tools=[])
    content, calls = required.read('[{"name": "g", "parameters": {"q": "\x1f"}}]')
    assert content == "" and calls[0]["function"]["name"] == "g"
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "\x1f"}
