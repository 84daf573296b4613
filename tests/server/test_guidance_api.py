"""A server whose engine uses the llguidance backend: the acceptance schemas and a
Lark grammar hold through the `openai` SDK, and what llguidance cannot read is the
client's 400, checked for that backend before anything is scheduled."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from bench.structured_schemas import SCHEMAS
from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.server.entrypoints.app import build_app
from tests.server.conftest import SMOL
from tests.support.http import assert_error
from tests.support.server import running_server


@pytest.fixture(scope="module")
def guided_url(default_model_dir):
    engine = Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                 num_kv_blocks=512, structured_outputs_backend="guidance"))
    with running_server(build_app(AsyncEngine(engine), [SMOL])) as base:
        yield base


def test_the_ten_schemas_and_a_lark_grammar_hold(guided_url):
    client = openai.OpenAI(base_url=f"{guided_url}/v1", api_key="none", max_retries=0)

    def generate(job):
        kind, value, seed = job
        extra = ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": value, "strict": True}}} if kind == "schema"
            else {"extra_body": {"structured_outputs": {"grammar": value}}})
        r = client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": "Answer in JSON."}],
            temperature=1.0, seed=seed, max_tokens=120, **extra)
        return r.choices[0].message.content

    jobs = [("schema", s, seed) for s in SCHEMAS for seed in range(2)]
    jobs.append(("grammar", 'start: "id-" /[0-9]{1,3}/ "!"', 0))
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(generate, jobs))
    for (kind, value, _), text in zip(jobs[:-1], texts[:-1]):
        jsonschema.validate(json.loads(text), value)
    assert re.fullmatch(r"id-[0-9]{1,3}!", texts[-1])


@pytest.mark.parametrize("field, value", [
    ("structured_outputs", {"grammar": "start: undefined_rule"}),
    ("guided_regex", "(unclosed"),
])
def test_what_llguidance_cannot_read_is_a_400(guided_url, field, value):
    body = {"model": SMOL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5, field: value}
    with httpx.Client(base_url=guided_url, timeout=60) as http:
        assert_error(http.post("/v1/chat/completions", json=body), 400, field)
