"""Reading streamed chunks: TTFT, tokens per chunk, usage, errors."""
from __future__ import annotations

import pytest

from kvserve.benchmarks.client.stream import StreamReader


def completion(text, logprob_tokens=None, usage=None):
    choice = {"index": 0, "text": text}
    if logprob_tokens is not None:
        choice["logprobs"] = {"tokens": logprob_tokens}
    chunk = {"choices": [choice]}
    if usage:
        chunk["usage"] = usage
    return chunk


def test_usage_gives_the_token_counts():
    r = StreamReader(chat=False)
    r.feed(completion("Hel"), 0.1)
    r.feed(completion("lo"), 0.2)
    r.feed({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}, 0.21)
    rec = r.finish(0.22, requested_input_len=100)
    assert rec.success and rec.ttft == 0.1 and rec.e2el == 0.22
    assert (rec.output_tokens, rec.prompt_tokens) == (4, 9)
    assert rec.answer == "Hello" and rec.chunk_times == [0.1, 0.2]


def test_without_usage_each_chunk_is_a_token_and_input_is_as_requested():
    r = StreamReader(chat=False)
    for t in (0.1, 0.2, 0.3):
        r.feed(completion("x"), t)
    rec = r.finish(0.3, requested_input_len=100)
    assert (rec.output_tokens, rec.prompt_tokens) == (3, 100)


def test_logprobs_or_continuous_usage_say_how_many_tokens_a_chunk_holds():
    r = StreamReader(chat=False)
    r.feed(completion("ab", logprob_tokens=["a", "b"]), 0.1)
    r.feed(completion("cde", logprob_tokens=["c", "d", "e"]), 0.4)
    assert r.record.chunk_tokens == [2, 3]
    r = StreamReader(chat=False)
    r.feed(completion("ab", usage={"completion_tokens": 2}), 0.1)
    r.feed(completion("c", usage={"completion_tokens": 5}), 0.4)
    assert r.record.chunk_tokens == [2, 3]
    assert r.finish(0.4, 1).itls() == pytest.approx([0.1, 0.1, 0.1])


def test_usage_first_seen_on_the_finish_chunk_is_not_that_chunks_tokens():
    """llama-server's stream: one token a chunk, usage only on the finish chunk."""
    r = StreamReader(chat=False)
    for i in range(4):
        r.feed(completion("x"), 0.1 * (i + 1))
    r.feed({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, 0.41)
    rec = r.finish(0.42, 1)
    assert rec.output_tokens == 4 and rec.chunk_tokens == [1, 1, 1, 1, 1]
    assert sum(rec.itls()) == pytest.approx(0.31)
    assert rec.itls() == pytest.approx([0.1, 0.1, 0.1, 0.01])


def test_chat_role_chunk_is_not_the_first_token_but_an_empty_text_chunk_is():
    r = StreamReader(chat=True)
    r.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 0.05)
    r.feed({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}, 0.1)
    r.feed({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]}, 0.2)
    rec = r.finish(0.2, 1)
    assert rec.ttft == 0.1 and rec.chunk_times == [0.1, 0.2] and rec.answer == "Hi"


def test_an_error_chunk_fails_the_request():
    r = StreamReader(chat=False)
    r.feed(completion("x"), 0.1)
    r.feed({"error": {"message": "engine died", "code": 500}}, 0.2)
    rec = r.finish(0.2, 1)
    assert not rec.success and rec.error == "engine died"


def test_a_stream_without_choices_fails():
    rec = StreamReader(chat=False).finish(0.1, 1)
    assert not rec.success and "without" in rec.error
