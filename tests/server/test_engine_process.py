"""The server with its engine in a separate process (ProcessEngine): same answers as
an in-process engine, aborts reach the child, a dead child turns into 503s."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from kvserve.engine.client.process_engine import EngineStartError, ProcessEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.modelstore.tokenizer import load_tokenizer
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error, parse_sse
from tests.support.server import running_server

MODEL = "tiny"
PROMPT = "The capital of France is"


def _config(model_dir) -> EngineConfig:
    # Stated, not auto: the engine process does not get the suite's eager float32.
    return EngineConfig(model=str(model_dir), num_kv_blocks=512, max_num_batched_tokens=256,
                        dtype="float32", compile="off")


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    engine = ProcessEngine(_config(model_dir), load_tokenizer(str(model_dir)))
    with running_server(build_app(engine, [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        yield http, engine


@pytest.fixture(scope="module")
def offline(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    return lambda ids, **p: engine.generate([ids], SamplingParams(**p))


def _complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_answers_match_the_in_process_engine(served, offline):
    http, engine = served
    ids = engine.tokenizer.encode(PROMPT)
    expected = offline(ids, max_tokens=12, temperature=0, ignore_eos=True)[0]
    body = _complete(http, prompt=ids, max_tokens=12, temperature=0, ignore_eos=True)
    assert body["choices"][0]["text"] == engine.tokenizer.decode(expected)
    seeded = dict(max_tokens=8, temperature=1.0, seed=5, n=2, ignore_eos=True)
    texts = [c["text"] for c in _complete(http, prompt=ids, **seeded)["choices"]]
    assert texts == [engine.tokenizer.decode(t) for t in offline(ids, **seeded)]


def test_streaming_and_usage(served):
    http, _ = served
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = parse_sse(r.read())
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_rejections_from_the_child_are_400(served):
    http, _ = served
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [10**6],
                                           "max_tokens": 2})
    assert_error(r, 400)


def test_disconnect_aborts_in_the_child(served):
    http, engine = served
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 5
    while engine.num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_running == 0 and engine.num_waiting == 0
    before = engine.stats.generation_tokens
    time.sleep(0.3)
    assert engine.stats.generation_tokens == before  # nothing is generating any more
    assert engine.stats.finished.get("abort", 0) >= 1


def test_a_killed_engine_process_turns_into_503(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    engine = ProcessEngine(_config(model_dir), load_tokenizer(str(model_dir)))
    with running_server(build_app(engine, [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        os.kill(engine._process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while engine.is_alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert_error(r, 503)


def test_a_model_that_cannot_load_fails_at_construction(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"]}')
    with pytest.raises(EngineStartError, match="failed to start"):
        ProcessEngine(EngineConfig(model=str(tmp_path)), tokenizer=None)


def test_the_tokenizer_loads_while_the_engine_process_starts(tiny_model_dir):
    """start_engine's order: the child first, then the tokenizer beside its start."""
    import multiprocessing

    model_dir = tiny_model_dir("llama")
    children_then = []

    def tokenizer():
        children_then.append(len(multiprocessing.active_children()))
        return load_tokenizer(str(model_dir))

    engine = ProcessEngine(_config(model_dir), load_tokenizer=tokenizer)
    try:
        assert children_then and children_then[0] >= 1
        assert engine.tokenizer is not None and engine.info.vocab_size > 0
    finally:
        engine.shutdown()  # never started: shut down all the same


def test_a_tokenizer_that_fails_leaves_no_engine_process(tiny_model_dir):
    import multiprocessing

    before = set(multiprocessing.active_children())

    def broken():
        raise OSError("no tokenizer here")

    with pytest.raises(OSError, match="no tokenizer"):
        ProcessEngine(_config(tiny_model_dir("llama")), load_tokenizer=broken)
    assert set(multiprocessing.active_children()) <= before


def test_auto_mode_is_a_process():
    from kvserve.engine.client.launch import pick_mode

    assert pick_mode("auto") == "process"
    assert pick_mode("thread") == "thread"
    assert pick_mode("process") == "process"
    with pytest.raises(ValueError, match="engine mode"):
        pick_mode("fork")
