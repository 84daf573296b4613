"""--reasoning-parser on its own: 20 recorded-style outputs of Qwen3 and DeepSeek-R1
(tags whole, missing, cut off, look-alikes, unicode), split whole and streamed with
the text cut at every boundary, and the two agree."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.server.reasoning import ReasoningParser, reasoning_parser

CASES = json.loads((Path(__file__).parent / "data" / "reasoning_outputs.json").read_text())
IDS = [f"{i}-{c['parser']}" for i, c in enumerate(CASES)]


def streamed(parser: ReasoningParser, prompt: str, pieces: list[str]) -> tuple[str, str]:
    stream = parser.stream(prompt)
    reasoning = answer = ""
    for piece in pieces:
        r, a = stream.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = stream.finish()
    return reasoning + r, answer + a


def test_there_are_twenty_recorded_outputs():
    assert len(CASES) == 20
    assert {c["parser"] for c in CASES} == {"qwen3", "deepseek_r1"}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_whole_output_splits_as_recorded(case):
    parser = reasoning_parser(case["parser"])
    assert parser.split(case["output"], "<prompt>" + case["prompt_end"]) == (
        case["reasoning"], case["answer"])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_streamed_output_split_at_every_one_and_two_boundaries_matches(case):
    parser = reasoning_parser(case["parser"])
    prompt, text = case["prompt_end"], case["output"]
    expected = (case["reasoning"] or "", case["answer"] or "")
    n = len(text)
    for i in range(n + 1):
        assert streamed(parser, prompt, [text[:i], text[i:]]) == expected, i
    for i in range(n + 1):
        for j in range(i, n + 1):
            assert streamed(parser, prompt, [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    # one character at a time: a tag is never whole in one piece
    assert streamed(parser, prompt, list(text)) == expected


def test_reasoning_is_released_as_soon_as_it_cannot_be_a_tag():
    stream = reasoning_parser("deepseek_r1").stream("<think>\n")
    assert stream.feed("abc </") == ("abc ", "")  # "</" may open </think>: held
    assert stream.feed("b>") == ("</b>", "")
    assert stream.feed("x</think") == ("x", "")
    assert stream.feed(">\n\nhi") == ("", "hi")
    assert stream.finish() == ("", "")


def test_where_the_reasoning_starts_is_read_off_the_prompt():
    qwen3 = reasoning_parser("qwen3")
    assert qwen3.opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not qwen3.opens_thinking("<|im_start|>assistant\n")
    assert not qwen3.opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen3.opens_thinking(None)
    assert reasoning_parser("deepseek_r1").opens_thinking("anything")


def test_parser_names():
    assert reasoning_parser("none") is None and reasoning_parser(None) is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("granite")
