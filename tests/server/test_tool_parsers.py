"""The Hermes tool-call format, parsed whole and streamed (any split of the text)."""
from __future__ import annotations

import json

import pytest

from server.tool_parsers import HermesStream, split_calls

TWO_CALLS = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
             '"arguments": {"zone": "CET"}}\n</tool_call>')


def test_text_before_two_calls():
    content, calls = split_calls(TWO_CALLS)
    assert content.strip() == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def test_text_alone_and_an_unclosed_call_stay_text():
    assert split_calls("no call <tool here>") == ("no call <tool here>", [])
    assert split_calls('a <tool_call>\n{"name": "x"') == ('a <tool_call>\n{"name": "x"', [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, 1000])
def test_streamed_in_any_pieces_no_markup_leaks(size):
    stream, content, calls = HermesStream(), "", []
    for at in range(0, len(TWO_CALLS), size):
        text, done = stream.feed(TWO_CALLS[at:at + size])
        assert "<" not in text and ">" not in text  # no piece of a tag, ever
        content, calls = content + text, calls + done
    content += stream.rest()
    assert (content, calls) == split_calls(TWO_CALLS)
