"""Tool calling in /v1/chat/completions. Every kind but Mistral's "auto" is enforced
by grammar, so a call's arguments are valid JSON for its function's schema on any
model (even one whose chat template knows no tools):
- a named function: the model writes the arguments object itself;
- "required": a JSON array of {"name": ..., "parameters": {...}} objects (one, unless
  `parallel_tool_calls`), each name one of the tools' and its parameters that tool's
  schema;
- "auto" (the default with tools): free text, in which calls are written in the
  model family's format (server/tool_formats.py: hermes, llama3_json, mistral) and
  parsed out (server/tool_parsers.py); a begun call must be a valid one (xgrammar's
  structural tag for the format). Templates that know no tools are told the hermes
  format in a system message; a template whose format no parser reads is a 400 for
  "auto" unless --tool-call-parser names one;
- "none": the tools are shown to the template, no call is made.
The answer is OpenAI's: `message.tool_calls` with ids, `content` null and finish
reason "tool_calls"; streamed, each call's id and name come first and its arguments
after, by index."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.scheduler.structured_output import StructuredOutput
from kvserve.server.errors import APIError
from kvserve.server.grammar_limits import GrammarLimits
from kvserve.server.structured_fields import checked
from kvserve.server.tool_formats import FORMATS, ToolFormat, knows_tools, tool_format

ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict]  # the request's tools, as sent (for the chat template)
    structured: StructuredOutput | None = None
    name: str | None = None  # the named function
    format: ToolFormat | None = None  # "auto": the calls' format

    def read(self, text: str) -> tuple[str, list[dict] | None]:
        """A finished output's content (what is not a call) and its tool calls (None:
        not parseable, e.g. cut short by max_tokens, then it is answered as text)."""
        if self.mode == "named":
            return "", [self.call(self.name, escaped_controls(text))]
        if self.mode == "auto":
            content, calls = self.format.split(text)
            return content.strip(), [self.call(name, args) for name, args in calls]
        try:
            items = json.loads(text, strict=False)  # raw control characters: see below
        except json.JSONDecodeError:
            return text, None
        return "", [self.call(item["name"], json.dumps(item["parameters"])) for item in items]

    @staticmethod
    def call(name: str, arguments: str) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}}


def escaped_controls(arguments: str) -> str:
    """The arguments as valid JSON. The JSON grammars let raw control characters
    (U+0000-U+001F) into strings, which strict parsers refuse; such arguments are
    written again with them escaped. Anything else is returned unchanged, byte for
    byte (so a call's whole arguments equal its streamed deltas whenever they can)."""
    try:
        json.loads(arguments)
        return arguments
    except json.JSONDecodeError:
        pass
    try:
        return json.dumps(json.loads(arguments, strict=False))
    except json.JSONDecodeError:
        return arguments  # not JSON at all (cut short): left for the client to see


def tool_plan(tools: Any, tool_choice: Any, parallel: Any, template: str | None = None,
              parser: str = "auto", backend: str = "xgrammar",
              limits: GrammarLimits = GrammarLimits()) -> ToolPlan | None:
    """The request's tool calling, checked (400s in OpenAI's shape), or None.
    template: the chat template the prompt goes through; parser: --tool-call-parser
    (they decide the format of "auto"); backend: the engine's structured outputs
    backend, which the grammar is checked for; limits: the caps on the tools'
    parameters (size and nesting), held before any grammar is made (their number was
    checked with the request's other counts: server/request_caps.py). Callers run it
    off the event loop (server/spec_thread.py)."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if not tools:
        return None
    schemas = _functions(tools)
    budget = [limits.spec_bytes]  # the parameters of all of them, together
    for schema in schemas.values():
        limits.check_json(schema, "tools", "tools' parameters", budget)
    if tool_choice == "none":
        return ToolPlan("none", tools)
    if tool_choice in (None, "auto"):
        fmt = tool_format(parser, template)
        if fmt is None:
            raise APIError(400, "tool_choice \"auto\" (the default with tools) needs a "
                           "parser for the format this chat template writes calls in, and "
                           "none of kvserve's (" + ", ".join(FORMATS) + ") matches it: "
                           "start the server with --tool-call-parser, or pass "
                           "\"required\", a named function or \"none\"",
                           "tool_choice", "unsupported_parameter")
        return ToolPlan("auto", tools, _auto_grammar(fmt, tools, parallel), format=fmt)
    if tool_choice == "required":
        one_of = [{"type": "object", "additionalProperties": False,
                   "required": ["name", "parameters"],
                   "properties": {"name": {"const": name}, "parameters": schema}}
                  for name, schema in schemas.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if parallel is False:
            array["maxItems"] = 1
        return _checked(ToolPlan("required", tools,
                                 StructuredOutput("json_schema", json.dumps(array))), backend)
    name = _named(tool_choice)
    if name not in schemas:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in "
                       "tools", "tool_choice")
    return _checked(ToolPlan("named", tools,
                             StructuredOutput("json_schema", json.dumps(schemas[name])), name),
                    backend)


def _auto_grammar(fmt: ToolFormat, tools: list[dict], parallel: Any) -> StructuredOutput | None:
    """Text, or calls in the format that are valid once begun (xgrammar's structural
    tag); None for a format parsed only."""
    if fmt.xgrammar_model is None:
        return None
    from xgrammar.builtin_structural_tag import get_model_structural_tag
    tag = get_model_structural_tag(fmt.xgrammar_model, tools=tools, tool_choice="auto",
                                   reasoning="disabled", parallel_tool_calls=parallel is not False)
    return checked(StructuredOutput("structural_tag", tag.model_dump_json()), "tools")


def _checked(plan: ToolPlan, backend: str) -> ToolPlan:
    """400 for parameters no grammar can be made of."""
    checked(plan.structured, "tools", backend)
    return plan


def _functions(tools: Any) -> dict[str, dict]:
    """name -> parameters schema of each function tool; 400 for a malformed list."""
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", "tools")
    out = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, "each tool must be {\"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"parameters\": {...}}}", "tools")
        if fn["name"] in out:
            raise APIError(400, f"two tools are named {fn['name']!r}", "tools")
        params = fn.get("parameters") or ANY_OBJECT
        if not isinstance(params, dict):
            raise APIError(400, f"tools: the parameters of {fn['name']!r} must be a JSON "
                           "schema object", "tools")
        out[fn["name"]] = params
    return out


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" \
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                       "tool_choice")
    return fn["name"]


def for_template(messages: list[dict], tools: list[dict] | None, template: str,
                 fmt: ToolFormat | None = None) -> list[dict]:
    """Messages a template without tool support can render (it never reads `tools`
    or `tool_calls`): the tools described in a system message, and each earlier call
    written into its assistant message as the model would have written it (in fmt,
    hermes unless told). A template that knows tools gets the messages as they are."""
    if knows_tools(template):
        return messages
    fmt = fmt or FORMATS["hermes"]
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            text = "\n".join(fmt.write(c["function"]["name"],
                                       _arguments(c["function"].get("arguments")))
                             for c in calls)
            content = m.get("content")
            if isinstance(content, list):  # content parts: the calls as one more
                m = {**m, "content": [*content, {"type": "text", "text": text}]}
            else:
                m = {**m, "content": ((content or "") + "\n" + text).strip()}
            m.pop("tool_calls")
        out.append(m)
    if tools:
        listing = json.dumps([t["function"] for t in tools])
        note = {"role": "system", "content": "You can call these functions:\n" + listing
                + "\nTo call one, write " + fmt.how_to_call()}
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{note['content']}"}
        else:
            out.insert(0, note)
    return out


def _arguments(arguments: Any) -> Any:
    """A call's arguments as sent back in the history: a JSON string, usually."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
