"""The caps on grammar specs (server/grammar_limits.py): each one past is a 400 naming
the field, found before the grammar library parses anything; a spec at the caps is
served; and specs are parsed off the event loop. On a tiny model: a tokenizer is all
a grammar needs."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.structured import grammars
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from kvserve.server.grammar_limits import GrammarLimits
from tests.support.http import assert_error, wait_idle
from tests.support.server import running_server

MODEL = "tiny"
LIMITS = dict(max_grammar_spec_bytes=2000, max_grammar_spec_depth=8, max_tools=3,
              max_guided_choices=4, max_regex_length=50)


@pytest.fixture(scope="module")
def served(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    app = build_app(AsyncEngine(engine), [MODEL], config=ServerConfig(**LIMITS))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        http.engine = engine
        yield http
    assert wait_idle(engine)


@pytest.fixture
def parses(monkeypatch):
    """The grammar library's parses (grammars.check) made while the test runs, and
    the thread each ran on."""
    calls = []
    check = grammars.check

    def spy(spec, backend="xgrammar"):
        calls.append(threading.current_thread().name)
        return check(spec, backend)

    monkeypatch.setattr(grammars, "check", spy)
    return calls


def nested(depth: int) -> dict:
    """A schema `depth` levels of objects and arrays deep."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


BIG_ENUM = {"enum": [f"value-{i:04d}" for i in range(200)]}  # ~2.6 KB as JSON
OBJ = {"type": "object", "properties": {"a": {"type": "string"}}}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, **fields}


@pytest.mark.parametrize("body, param, flag", [
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": BIG_ENUM}}), "response_format", "--max-grammar-spec-bytes"),
    (chat(guided_json='{"enum": [' + ", ".join(['"xxxxxxxx"'] * 200) + "]}"),
     "guided_json", "--max-grammar-spec-bytes"),
    (chat(guided_grammar='root ::= "' + "a" * 2100 + '"'), "guided_grammar",
     "--max-grammar-spec-bytes"),
    (chat(response_format={"type": "structural_tag", "format": {
        "type": "const_string", "value": "x" * 2100}}), "response_format",
     "--max-grammar-spec-bytes"),
    (chat(structured_outputs={"json": nested(9)}), "structured_outputs",
     "--max-grammar-spec-depth"),
    (chat(guided_json='{"items": ' * 100 + "{}" + "}" * 100), "guided_json",
     "--max-grammar-spec-depth"),
    (chat(tools=[tool(f"t{i}", OBJ) for i in range(4)], tool_choice="required"), "tools",
     "--max-tools"),
    (chat(tools=[tool("a", BIG_ENUM)], tool_choice="none"), "tools",
     "--max-grammar-spec-bytes"),
    (chat(tools=[tool("a", {"type": "object", "properties": {
        "p": {"enum": [f"v{i:04d}" for i in range(150)]}}}),
        tool("b", {"type": "object", "properties": {
            "q": {"enum": [f"w{i:04d}" for i in range(150)]}}})]), "tools",
     "--max-grammar-spec-bytes"),  # each under the cap, together over it
    (chat(tools=[tool("a", {"type": "object", "properties": {"p": nested(8)}})],
          tool_choice={"type": "function", "function": {"name": "a"}}), "tools",
     "--max-grammar-spec-depth"),
    (chat(guided_choice=["a", "b", "c", "d", "e"]), "guided_choice",
     "--max-guided-choices"),
    (chat(structured_outputs={"regex": "[a-z]" * 11}), "structured_outputs",
     "--max-regex-length"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "string", "pattern": "^" + "[0-9]" * 10 + "$"}}}), "response_format",
     "--max-regex-length"),
])
def test_each_cap_is_a_400_naming_the_field_before_any_parse(served, parses, body, param,
                                                             flag):
    err = assert_error(served.post("/v1/chat/completions", json=body), 400, param)
    assert flag in err["message"]
    assert parses == []  # refused before the grammar library saw it


def test_completions_hold_structured_outputs_to_the_caps_too(served, parses):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2,
            "guided_choice": ["a", "b", "c", "d", "e"]}
    err = assert_error(served.post("/v1/completions", json=body), 400, "guided_choice")
    assert "--max-guided-choices" in err["message"] and parses == []


def test_specs_at_the_caps_are_served(served, parses):
    choices = ["yes", "no", "maybe", "never"]
    r = served.post("/v1/chat/completions", json=chat(guided_choice=choices))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in choices
    r = served.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                             "guided_regex": "[ab]{1,2}" * 5 + "[0-9]"})
    assert r.status_code == 200, r.text
    r = served.post("/v1/chat/completions", json=chat(
        tools=[tool(f"t{i}", OBJ) for i in range(3)], tool_choice="required", max_tokens=8))
    assert r.status_code == 200, r.text
    r = served.post("/v1/chat/completions", json=chat(structured_outputs={"json": nested(8)},
                                                      max_tokens=4))
    assert r.status_code == 200, r.text
    assert parses and set(parses) == {"kvserve-spec_0"}  # never the event loop's thread


def test_a_slow_parse_leaves_the_event_loop_free(served, monkeypatch):
    """A parse of seconds (a spec under the caps can still be a slow one) runs on the
    spec thread: /health answers meanwhile."""
    check = grammars.check

    def slow(spec, backend="xgrammar"):
        if spec.kind == "regex" and spec.spec == "[xy]{3}":
            time.sleep(1.5)
        return check(spec, backend)

    monkeypatch.setattr(grammars, "check", slow)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "guided_regex": "[xy]{3}"}
    with ThreadPoolExecutor(1) as pool:
        slow_request = pool.submit(served.post, "/v1/completions", json=body)
        time.sleep(0.3)  # it is parsing now
        t0 = time.monotonic()
        assert served.get("/health").status_code == 200
        assert time.monotonic() - t0 < 0.5 and not slow_request.done()
        assert slow_request.result().status_code == 200


def test_the_walk_counts_bytes_as_json_would_and_needs_no_recursion():
    limits = GrammarLimits(spec_bytes=100, depth=0)
    limits.check_json({"k": ["é" * 40]}, "f", "spec")  # 80 bytes of UTF-8: under
    with pytest.raises(Exception, match="larger than 100 bytes"):
        limits.check_json({"k": ["é" * 50]}, "f", "spec")
    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    GrammarLimits(spec_bytes=0, depth=0).check_json(deep, "f", "spec")
    with pytest.raises(Exception, match="more than 64 levels"):
        GrammarLimits().check_json(deep, "f", "spec")
