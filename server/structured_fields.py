"""The request fields that ask for structured output, in OpenAI's and vLLM's spellings,
read into one StructuredOutput and checked (a bad schema, regex or grammar is the
client's 400 before anything is scheduled):
- `response_format`: {"type": "json_object"}, {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}} or vLLM's {"type": "structural_tag", "format": ...}
  (xgrammar's structural tag) ({"type": "text"} asks for nothing);
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" |
  "json_object" | "structural_tag": ...}, one of them;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Each spec is held to the caps (server/grammar_limits.py) before it is serialised or
parsed; callers run all of it off the event loop (server/spec_thread.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.scheduler.structured_output import StructuredOutput
from kvserve.server.errors import APIError
from kvserve.server.grammar_limits import GrammarLimits

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex",
           "guided_choice": "choice", "guided_grammar": "grammar"}
_VLLM = {"json": "json_schema", "regex": "regex", "choice": "choice",
         "grammar": "grammar", "json_object": "json_object",
         "structural_tag": "structural_tag"}


@dataclass(frozen=True)
class AskedGrammar:
    """A request's grammar and the field it came in (named by any 400 about it, the
    engine's refusal of its compile included)."""
    spec: StructuredOutput
    param: str


def asks_for_structure(req) -> bool:
    """Whether any structured-output field is set (cheap: no spec is read)."""
    extra = req.model_extra or {}
    return any(extra.get(name) not in (None, "", [], {})
               for name in ("response_format", "structured_outputs", *_GUIDED))


def structured_output(req, backend: str = "xgrammar",
                      limits: GrammarLimits = GrammarLimits()) -> AskedGrammar | None:
    """The request's structured output, held to `limits` and checked once here for
    the engine's backend (400 if invalid), or None."""
    found = []  # (field, StructuredOutput)
    extra = req.model_extra or {}
    fmt = extra.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt, limits)
        if spec is not None:
            found.append(("response_format", spec))
    outputs = extra.get("structured_outputs")
    if outputs:
        found.append(("structured_outputs", _structured_outputs(outputs, limits)))
    for name, kind in _GUIDED.items():
        if extra.get(name) not in (None, "", [], {}):
            found.append((name, _spec(name, kind, extra[name], limits)))
    if len(found) > 1:
        raise APIError(400, "only one kind of structured output may be asked for; got "
                       + ", ".join(f"`{n}`" for n, _ in found), found[1][0])
    if not found:
        return None
    name, spec = found[0]
    return AskedGrammar(checked(spec, name, backend), name)


def checked(spec: StructuredOutput, param: str, backend: str = "xgrammar") -> StructuredOutput:
    """spec, once the backend can make a grammar of it; else a 400 naming `param`."""
    # Imported here: the grammar libraries bring torch, which the front end otherwise
    # never loads (1.5 s, once, at the first structured request).
    from kvserve.engine.structured.grammars import check
    try:
        check(spec, backend)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param) from None
    return spec


def _response_format(fmt: Any, limits: GrammarLimits) -> StructuredOutput | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise APIError(400, "response_format: json_schema needs a `json_schema` object "
                           "with a `schema`", "response_format")
        if not isinstance(body.get("name"), str) or not body["name"]:
            raise APIError(400, "response_format: json_schema needs a `name`",
                           "response_format")
        return _spec("response_format", "json_schema", body["schema"], limits)
    if kind == "structural_tag":  # the whole object is xgrammar's structural tag
        return _spec("response_format", "structural_tag", fmt, limits)
    raise APIError(400, "response_format: `type` must be one of text, json_object, "
                   f"json_schema, structural_tag; got {kind!r}", "response_format")


def _structured_outputs(outputs: Any, limits: GrammarLimits) -> StructuredOutput:
    asked = {k: v for k, v in outputs.items() if k in _VLLM and v not in (None, False)} \
        if isinstance(outputs, dict) else {}
    if len(asked) != 1:
        raise APIError(400, "structured_outputs: give exactly one of "
                       + ", ".join(_VLLM), "structured_outputs")
    (key, value), = asked.items()
    return _spec("structured_outputs", _VLLM[key], value, limits)


def _spec(name: str, kind: str, value: Any, limits: GrammarLimits) -> StructuredOutput:
    """value as the field sent it -> StructuredOutput (its text form), within limits
    before it is serialised."""
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        if isinstance(value, str):
            value = limits.check_json_text(value, name, "JSON schema")
        elif isinstance(value, (dict, bool)):
            limits.check_json(value, name, "JSON schema")
        if not isinstance(value, (dict, bool)):
            raise APIError(400, f"{name}: a JSON schema is an object", name)
        return StructuredOutput("json_schema", json.dumps(value))
    if kind == "structural_tag":
        if isinstance(value, dict):
            limits.check_json(value, name, "structural tag")
            value = json.dumps(value)
        elif isinstance(value, str) and value:
            limits.check_json_text(value, name, "structural tag")
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value) \
                or not value:
            raise APIError(400, f"{name}: choice is a list of non-empty strings", name)
        limits.check_choices(value, name)
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{name}: a {kind} is a non-empty string", name)
    if kind == "regex":
        limits.check_regex(value, name)
    else:
        limits.check_text(value, name, kind)
    return StructuredOutput(kind, value)
