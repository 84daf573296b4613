"""Faults through a real server. A request the engine fails alone (an exception in its
sampling, armed with engine.faults; NaN logits from the model, in an engine process)
gets a 500 in OpenAI's error shape, or an error event mid-stream, while the requests
beside it complete and the server serves on. An engine loop that dies answers every
open request with an error within seconds and turns /health to 503."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.client.process_engine import ProcessEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.platform import faults
from kvserve.modelstore.tokenizer import load_tokenizer
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.server.entrypoints.app import build_app
from tests.engine.test_fault_isolation import poisoned_copy
from tests.support.http import assert_error, parse_sse, wait_idle
from tests.support.server import running_server

MODEL = "tiny"
FAULTY = [77, 78, 79]  # the prompt the armed fault fails
TOKENS = 16


def body(prompt, stream: bool = False, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": stream, **kw}


async def _send(c: httpx.AsyncClient, b: dict) -> tuple[int, list[dict] | dict]:
    """(status, SSE events) for a stream, else (status, JSON body)."""
    r = await c.post("/v1/completions", json=b)
    return r.status_code, (parse_sse(r.content) if b["stream"] else r.json())


def send_all(url: str, bodies: list[dict]) -> list[tuple[int, object]]:
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(*(_send(c, b) for b in bodies))
    return asyncio.run(go())


def completed(result, stream: bool) -> bool:
    """A 200 that ran to max_tokens ("length")."""
    status, got = result
    if status != 200:
        return False
    if stream:
        finishes = [ch["choices"][0]["finish_reason"] for ch in got if ch.get("choices")]
        return finishes[-1] == "length" and "error" not in got[-1]
    return got["choices"][0]["finish_reason"] == "length" \
        and got["usage"]["completion_tokens"] == TOKENS


@pytest.fixture(scope="module")
def srv(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    with faults.armed(faults.prompt_is(FAULTY), "sample", message="sampling bug"), \
            running_server(build_app(AsyncEngine(engine), [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        http.engine, http.url = engine, url
        yield http


def test_faulted_request_fails_alone_while_others_complete(srv):
    others = [body([5 + i, 6, 7], stream=i % 2 == 1) for i in range(4)]
    results = send_all(srv.url, [body(FAULTY), body(FAULTY, stream=True), *others])
    status, err = results[0]
    assert status == 500 and set(err) == {"error"}
    assert err["error"]["type"] == "server_error"
    assert "InjectedFault: sampling bug" in err["error"]["message"]
    status, events = results[1]
    assert status == 200 and events[-1]["error"]["type"] == "server_error"
    assert "sampling bug" in events[-1]["error"]["message"]
    assert all(completed(r, b["stream"]) for r, b in zip(results[2:], others))
    assert wait_idle(srv.engine)


def test_all_n_sequences_of_a_faulted_request_end_and_free_their_blocks(srv):
    err = assert_error(srv.post("/v1/completions", json=body(FAULTY, n=3)), 500)
    assert "sampling bug" in err["message"]
    assert wait_idle(srv.engine)
    assert srv.get("/metrics").status_code == 200


def test_the_server_serves_normally_afterwards(srv):
    r = srv.post("/v1/completions", json=body([5, 6, 7]))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == TOKENS
    assert srv.get("/health").status_code == 200
    assert wait_idle(srv.engine)


# -- NaN logits, with the engine in its own process --------------------------------
def test_nan_logits_answer_500_through_an_engine_process(tiny_model_dir, tmp_path,
                                                         tiny_engine_factory):
    others = [[5, 6, 7], [8, 9, 10, 11]]
    clean = tiny_engine_factory("llama").generate(
        others, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    used = {t for seq in [*clean, *others] for t in seq}
    poison = next(t for t in range(100, 300) if t not in used)
    model = poisoned_copy(tiny_model_dir("llama"), tmp_path / "poisoned", poison)
    engine = ProcessEngine(EngineConfig(model=str(model), num_kv_blocks=512,
                                        max_num_batched_tokens=256),
                           load_tokenizer(str(model)))
    with running_server(build_app(engine, [MODEL])) as url:
        results = send_all(url, [body([30, poison, 31]), body([30, poison], stream=True),
                                 *(body(p) for p in others)])
        assert engine.is_alive
    status, err = results[0]
    assert status == 500 and "NaN/inf" in err["error"]["message"], err
    assert "NaN/inf" in results[1][1][-1]["error"]["message"]
    assert all(completed(r, False) for r in results[2:]), results[2:]


# -- the engine loop itself dies ----------------------------------------------------
def test_engine_loop_death_answers_everyone_and_health_turns_503(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    in_flight = [body([5 + i, 6, 7], stream=i % 2 == 0, max_tokens=3000) for i in range(4)]

    def device_lost(*args, **kwargs):
        raise RuntimeError("device lost")

    async def go(url):
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            tasks = [asyncio.create_task(_send(c, b)) for b in in_flight]
            while len(engine.scheduler.running) < len(in_flight):  # all generating
                await asyncio.sleep(0.05)
            engine.runner.forward_logits = device_lost
            died = time.monotonic()
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - died, (await c.get("/health")).status_code

    with running_server(build_app(AsyncEngine(engine), [MODEL])) as url:
        results, answered_in, health = asyncio.run(go(url))
    assert answered_in < 5
    assert health == 503
    for (status, got), b in zip(results, in_flight):
        if b["stream"]:
            assert status == 200 and got[-1]["error"]["type"] == "service_unavailable"
        else:
            assert status == 503 and got["error"]["type"] == "service_unavailable"
