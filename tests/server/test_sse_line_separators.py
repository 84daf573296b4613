"""U+2028, U+2029 and U+0085 in streamed text. They are legal raw inside JSON, but
a client that splits the stream with a Unicode line splitter (httpx's aiter_lines,
Python's str.splitlines) cuts an event at them. The server escapes them in every
streamed JSON, and kvserve's bench client frames SSE by CR/LF only, as the SSE spec
says, so it reads any server's raw ones too."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.benchmarks.client.client import Target, send
from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.server.entrypoints.app import build_app
from tests.support.http import parse_sse
from tests.support.server import running_server
from tests.support.tiny_models import make_tiny_model

MODEL = "tiny-separators"
SEPARATED = "a\u2028b\u2029c\x85"  # one token of the model's vocabulary
RAW_BREAKS = ("\u2028".encode(), "\u2029".encode(), "\x85".encode())
N = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-separators"),
                           extra_tokens=(SEPARATED,))
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=128))
    token = engine.tokenizer.convert_tokens_to_ids(SEPARATED)
    with running_server(build_app(AsyncEngine(engine), [MODEL])) as url:
        yield url, token


def routes(token: int) -> dict[str, tuple[str, dict, str]]:
    """name -> (path, body, the text the stream must carry)."""
    forced = {"model": MODEL, "max_tokens": N, "temperature": 0, "ignore_eos": True,
              "logit_bias": {str(token): 100}}
    prompt = f"x{SEPARATED}y"
    return {
        "completions": ("/v1/completions", {**forced, "prompt": "hello"}, SEPARATED * N),
        "completions echo": ("/v1/completions",
                             {**forced, "prompt": prompt, "echo": True, "max_tokens": 1},
                             prompt + SEPARATED),
        "chat": ("/v1/chat/completions",
                 {**forced, "messages": [{"role": "user", "content": prompt}]},
                 SEPARATED * N),
    }


def chunk_text(chunk: dict) -> str:
    choice = chunk["choices"][0] if chunk["choices"] else {}
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


@pytest.mark.parametrize("route", ["completions", "completions echo", "chat"])
def test_every_streaming_route_escapes_unicode_line_breaks(served, route):
    url, token = served
    path, body, expected = routes(token)[route]
    raw = httpx.post(url + path, json={**body, "stream": True}, timeout=60).content
    for char in RAW_BREAKS:
        assert char not in raw, (route, char)
    chunks = parse_sse(raw)
    assert "".join(map(chunk_text, chunks)) == expected
    # A client that splits lines the Unicode way (httpx.aiter_lines, str.splitlines)
    # gets every event whole.
    lines = [line for line in raw.decode().splitlines() if line]
    assert [json.loads(line[6:]) for line in lines[:-1]] == chunks
    # The same text as the whole (non-streamed) body, which is JSON parsed whole.
    whole = httpx.post(url + path, json=body, timeout=60).json()["choices"][0]
    assert whole.get("text", (whole.get("message") or {}).get("content")) == expected


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_bench_client_round_trips_them_through_the_server(served, route):
    url, token = served
    path, body, expected = routes(token)[route]
    target = Target(path, MODEL, sampling={"temperature": 0,
                                           "logit_bias": body["logit_bias"]})
    prompt = body.get("messages") or body["prompt"]

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await send(http, target, prompt, N, input_len=1)

    record = asyncio.run(run())
    assert record.success, record.error
    assert record.answer == expected
    assert record.output_tokens == N


def raw_stream(text: str) -> bytes:
    """A server that writes the separators raw, as JSON allows (not kvserve)."""
    chunks = [{"choices": [{"index": 0, "text": text}]},
              {"choices": [{"index": 0, "text": text}]},
              {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                        "total_tokens": 3}}]
    events = [f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks]
    return ("".join(events) + "data: [DONE]\n\n").encode()


def test_the_bench_client_reads_raw_separators_from_any_server():
    body = raw_stream(SEPARATED)
    assert all(char in body for char in RAW_BREAKS)

    async def handle(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body,
                              headers={"content-type": "text/event-stream"})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle),
                                     base_url="http://raw") as http:
            return await send(http, Target("/v1/completions", "m"), "p", 2, input_len=1)

    record = asyncio.run(run())
    assert record.success, record.error
    assert record.answer == SEPARATED * 2
    assert len(record.chunk_times) == 2
