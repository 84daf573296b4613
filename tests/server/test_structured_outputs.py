"""Structured outputs through the real `openai` SDK, on the default model sampling at
temperature 1 (unconstrained, it would not produce these formats)."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pydantic
import pytest

from bench.structured_schemas import SCHEMAS
from tests.server.conftest import SMOL
from tests.support.http import assert_error

MODEL = SMOL
class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_fifty_generations_over_ten_schemas_all_validate(smol_client):
    """Issue 19's acceptance: 5 seeds x 10 schemas, sent at once (one batch)."""
    def generate(job):
        schema, seed = job
        r = smol_client.chat.completions.create(
            model=MODEL, messages=chat("Answer in JSON."), temperature=1.0, seed=seed,
            max_tokens=120, response_format={"type": "json_schema", "json_schema": {
                "name": "answer", "schema": schema, "strict": True}})
        return schema, r.choices[0].message.content

    jobs = [(schema, seed) for schema in SCHEMAS for seed in range(5)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(generate, jobs))
    assert len(results) == 50
    for schema, text in results:
        jsonschema.validate(json.loads(text), schema)


def test_parse_returns_the_pydantic_object(smol_client):
    r = smol_client.chat.completions.parse(model=MODEL, messages=chat("Who are you?"),
                                      temperature=1.0, max_tokens=60, response_format=Person)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_regex_and_choice_through_vllm_fields(smol_client):
    r = smol_client.completions.create(model=MODEL, prompt="A phone number:", temperature=1.0,
                                  max_tokens=20, extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    r = smol_client.chat.completions.create(
        model=MODEL, messages=chat("Is the sky green?"), temperature=1.0, max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")


def test_a_structural_tag_frames_the_output(smol_client):
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "regex", "pattern": "[0-9]{3}"}]}}
    r = smol_client.chat.completions.create(model=MODEL, messages=chat("A number?"),
                                       temperature=1.0, max_tokens=20, response_format=tag)
    assert re.fullmatch(r"Answer: [0-9]{3}", r.choices[0].message.content)


def test_streamed_json_reassembles(smol_client):
    stream = smol_client.chat.completions.create(
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
    ("structured_outputs", {"structural_tag": {"type": "structural_tag",
                                               "format": {"type": "nope"}}}),
])
def test_bad_structured_outputs_are_400s_before_anything_runs(smol_url, field, value):
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 3, field: value}
    with httpx.Client(base_url=smol_url, timeout=60) as http:
        err = assert_error(http.post("/v1/chat/completions", json=body), 400, field)
    assert field in err["message"]


def test_constrained_requests_and_compile_times_reach_the_metrics(smol_client, smol_url):
    with httpx.Client(base_url=smol_url, timeout=60) as http:
        def scrape() -> str:
            return http.get("/metrics").text

        def value(text: str, name: str) -> float:
            line = next(l for l in text.splitlines() if l.startswith(f"kvserve:{name}{{"))
            return float(line.rsplit(" ", 1)[1])

        before = scrape()
        schema = {"type": "object", "required": ["n"], "additionalProperties": False,
                  "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
        smol_client.chat.completions.create(
            model=MODEL, messages=chat("A digit in JSON"), max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "d",
                                                                     "schema": schema}})
        smol_client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2)
        after = scrape()
    assert value(after, "structured_output_requests_total") \
        == value(before, "structured_output_requests_total") + 1
    # a schema no other test uses: compiled once, here
    assert value(after, "structured_output_compile_seconds_count") \
        == value(before, "structured_output_compile_seconds_count") + 1
