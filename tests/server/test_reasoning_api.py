"""--reasoning-parser through the server, on a tiny random Qwen3-architecture model whose
vocabulary has <think> and </think> as tokens and whose chat template is Qwen3's in
shape (enable_thinking false writes an empty thought; otherwise the prompt leaves
<think> open, as Qwen3's thinking models do). The random model writes </think> where
a logit bias makes it likely, so each output has reasoning and an answer; the split
is checked against the same tokens from /v1/completions, streamed and whole."""
from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from kvserve.server.reasoning import reasoning_parser
from tests.support.http import parse_sse
from tests.support.server import running_server
from tests.support.tiny_models import make_tiny_model

MODEL = "tiny-qwen3-thinking"
QWEN3_SHAPED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-thinking"), arch="qwen3",
                           extra_tokens=("<think>", "</think>"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = QWEN3_SHAPED
    tokenizer.save_pretrained(str(path))
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=256))
    app = build_app(AsyncEngine(engine), [MODEL],
                    config=ServerConfig(reasoning_parser="qwen3"))
    with running_server(app) as url:
        yield url, tokenizer, engine


def completion_of(url: str, tokenizer, body: dict, **template) -> tuple[str, str]:
    """(the prompt text, the text /v1/completions samples for it with `body`'s settings)."""
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                         **template)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    out = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ids}, timeout=60)
    return text, out.json()["choices"][0]["text"]


def biased(tokenizer, seed: int) -> dict:
    end = tokenizer.convert_tokens_to_ids("</think>")
    return {"model": MODEL, "max_tokens": 40, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "logit_bias": {str(end): 4}}


@pytest.mark.parametrize("seed", [0, 2, 3])  # seeds whose output thinks first
def test_thought_and_answer_split_whole_and_streamed(served, seed):
    url, tokenizer, engine = served
    body = biased(tokenizer, seed)
    prompt, raw = completion_of(url, tokenizer, body)
    assert prompt.endswith("<think>\n") and "</think>" in raw  # the case under test
    reasoning, answer = reasoning_parser("qwen3").split(raw, prompt)
    assert reasoning and reasoning == raw[:raw.index("</think>")]

    whole = httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": MESSAGES},
                       timeout=60).json()["choices"][0]["message"]
    assert (whole["reasoning_content"], whole["content"]) == (reasoning, answer)

    stream = httpx.post(f"{url}/v1/chat/completions",
                        json={**body, "messages": MESSAGES, "stream": True}, timeout=60)
    deltas = [c["choices"][0]["delta"] for c in parse_sse(stream.content) if c["choices"]]
    streamed_reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    streamed_answer = "".join(d.get("content") or "" for d in deltas)
    assert (streamed_reasoning, streamed_answer or None) == (reasoning, answer)
    kinds = ["r" if d.get("reasoning_content") else "a" for d in deltas if any(
        d.get(k) for k in ("reasoning_content", "content"))]
    assert "".join(kinds) == "".join(sorted(kinds, reverse=True))  # thought, then answer
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_enable_thinking_false_reaches_the_template_and_all_is_answer(served):
    url, tokenizer, _ = served
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompt, raw = completion_of(url, tokenizer, body, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    message = httpx.post(f"{url}/v1/chat/completions", json={
        **body, "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
        timeout=60).json()["choices"][0]["message"]
    assert message["reasoning_content"] is None
    assert message["content"] == raw.lstrip() == reasoning_parser("qwen3").split(raw, prompt)[1]


def test_the_openai_sdk_reads_reasoning_content(served):
    url, tokenizer, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    body = biased(tokenizer, 0)
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=body["max_tokens"], seed=0,
        extra_body={"ignore_eos": True, "logit_bias": body["logit_bias"]})
    assert out.choices[0].message.model_extra["reasoning_content"]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=body["max_tokens"], seed=0, stream=True,
        extra_body={"ignore_eos": True, "logit_bias": body["logit_bias"]}))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in chunks if c.choices)
    assert streamed == out.choices[0].message.model_extra["reasoning_content"]


def test_a_grammar_from_the_first_token_leaves_no_room_for_reasoning(served):
    url, _, _ = served
    message = httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
        "structured_outputs": {"choice": ["Paris", "Rome"]}}, timeout=60).json()
    message = message["choices"][0]["message"]
    assert message["content"] in ("Paris", "Rome") and message["reasoning_content"] is None


def test_responses_carry_the_reasoning_as_a_reasoning_item(served):
    from openai.types.responses import Response

    from tests.server.test_responses_api import stream_events

    url, tokenizer, _ = served
    body = biased(tokenizer, 0)
    prompt, raw = completion_of(url, tokenizer, body)
    reasoning, answer = reasoning_parser("qwen3").split(raw, prompt)
    request = {"model": MODEL, "input": MESSAGES[0]["content"], "seed": 0,
               "max_output_tokens": body["max_tokens"], "temperature": 1.0,
               "ignore_eos": True, "logit_bias": body["logit_bias"]}
    whole = Response.model_validate(httpx.post(f"{url}/v1/responses", json=request,
                                               timeout=60).json())
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == reasoning
    assert whole.output[1].content[0].text == answer
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    events = stream_events(url, request)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (reasoning, answer)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    texts = [[(o.type, o.content[0].text) for o in r.output]
             for r in (events[-1].response, whole)]
    assert texts[0] == texts[1]
    # the next turn hands the reasoning back to the template with the assistant's turn
    again = httpx.post(f"{url}/v1/responses", json={
        "model": MODEL, "input": "And Italy?", "previous_response_id": whole.id,
        "max_output_tokens": 4}, timeout=60)
    assert again.status_code == 200
