"""Structured outputs through the real `openai` SDK, on the default model sampling at
temperature 1 (unconstrained, it would not produce these formats)."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from engine.client.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import Engine
from server.app import build_app
from tests.support.http import assert_error
from tests.support.server import running_server

MODEL = "smol"
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
     "properties": {"city": {"type": "string", "maxLength": 16},
                    "rank": {"type": "integer", "minimum": 1, "maximum": 10}}},
    {"type": "object", "required": ["tags"], "additionalProperties": False,
     "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                             "items": {"enum": ["a", "b", "c"]}}}},
    {"type": "object", "required": ["code", "owner"], "additionalProperties": False,
     "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                    "owner": {"type": "object", "required": ["ok"],
                              "additionalProperties": False,
                              "properties": {"ok": {"type": "boolean"}}}}},
]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def url(default_model_dir):
    engine = Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                 num_kv_blocks=512))
    with running_server(build_app(AsyncEngine(engine), [MODEL])) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_validate(client, schema):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=chat("Answer in JSON."), temperature=1.0, seed=seed,
            max_tokens=80, response_format={"type": "json_schema", "json_schema": {
                "name": "answer", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(model=MODEL, messages=chat("Who are you?"),
                                      temperature=1.0, max_tokens=60, response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_regex_and_choice_through_vllm_fields(client):
    r = client.completions.create(model=MODEL, prompt="A phone number:", temperature=1.0,
                                  max_tokens=20, extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    r = client.chat.completions.create(
        model=MODEL, messages=chat("Is the sky green?"), temperature=1.0, max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")


def test_streamed_json_reassembles(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=chat("JSON please"), temperature=1.0, max_tokens=80,
        stream=True, response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": SCHEMAS[0]}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[0])


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "nonsense"}}}),
    ("response_format", {"type": "xml"}),
    ("guided_regex", "(unclosed"),
    ("guided_grammar", "root ::= "),
    ("guided_choice", ["ok", ""]),
    ("structured_outputs", {"json": {"type": "object"}, "regex": "a"}),
])
def test_bad_structured_outputs_are_400s_before_anything_runs(url, field, value):
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 3, field: value}
    with httpx.Client(base_url=url, timeout=60) as http:
        err = assert_error(http.post("/v1/chat/completions", json=body), 400, field)
    assert field in err["message"]
