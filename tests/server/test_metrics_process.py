"""The new report fields cross the pipe: with the engine in its own process
(ProcessEngine), the engine-side counters and histograms still add up."""
from __future__ import annotations

import pickle
import time

import httpx
import pytest

from kvserve.engine.client.messages import StepReport
from kvserve.engine.client.process_engine import ProcessEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.platform.outputs import RequestOutput, RequestTimes
from kvserve.modelstore.tokenizer import load_tokenizer
from kvserve.server.entrypoints.app import build_app
from tests.support.metrics_script import Scrapes, complete
from tests.support.server import running_server

MODEL = "tiny"
P = "kvserve:"


@pytest.fixture(scope="module")
def http(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    config = EngineConfig(model=str(model_dir), num_kv_blocks=512, max_num_batched_tokens=256)
    engine = ProcessEngine(config, load_tokenizer(str(model_dir)))
    with running_server(build_app(engine, [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        yield c


def test_a_report_is_plain_picklable_data():
    out = RequestOutput("r", new_token_ids=[1], finished=True, finish_reason="length",
                        times=RequestTimes(0.1, 0.2, 0.3, 4))
    rep = StepReport(outputs=[out], step_tokens=9, prefix_queries=5, prefix_hits=2,
                     preemptions=1, kv_usage=0.25)
    assert pickle.loads(pickle.dumps(rep)) == rep


def test_engine_fields_reach_the_front_end(http):
    scrapes = Scrapes(http, MODEL)
    sent = [complete(http, MODEL, [5, 6, 7, 8, 9, 10], 4),
            complete(http, MODEL, [11, 12, 13, 14, 15, 16, 17], 3, stream=True)]
    deadline = time.monotonic() + 10
    while (after := scrapes.now())[(P + "kv_cache_usage_perc", ())] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)

    def grew(name, **labels):
        return scrapes.delta(after, P + name, **labels)

    assert [s.tokens for s in sent] == [[4], [3]]
    assert grew("prompt_tokens_total") == grew("prefix_cache_queries_total") == 13
    assert grew("generation_tokens_total") == 7
    assert grew("request_success_total", finished_reason="length") == 2
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "time_to_first_token_seconds",
                 "e2e_request_latency_seconds"):
        assert grew(name + "_count") == 2, name
    assert grew("request_generation_tokens_sum") == 7
    assert grew("iteration_tokens_total_sum") == 13 + 7
    assert grew("request_decode_time_seconds_sum") > 0
