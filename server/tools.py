"""Tool calling in /v1/chat/completions. Every kind is enforced by grammar, so a
call's arguments are valid JSON for its function's schema on any model (even one
whose chat template knows no tools):
- a named function: the model writes the arguments object itself;
- "required": a JSON array of {"name": ..., "parameters": {...}} objects (one, unless
  `parallel_tool_calls`), each name one of the tools' and its parameters that tool's
  schema;
- "auto" (the default with tools): free text, in which a call is written in the
  Hermes format (server/tool_parsers.py) and, once begun, must be a valid call
  (xgrammar's structural tag for it). Served for templates in that format (Qwen,
  Hermes: they write `<tool_call>`) and for templates that know no tools (told the
  format in a system message); other families' formats are not parsed yet (400);
- "none": the tools are shown to the template, no call is made.
The answer is OpenAI's: `message.tool_calls` with ids, `content` null and finish
reason "tool_calls"; streamed, each call's id and name come first and its arguments
after, by index."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from scheduler.structured_output import StructuredOutput
from server.errors import APIError
from server.structured_fields import checked
from server.tool_parsers import END, START, split_calls

ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict]  # the request's tools, as sent (for the chat template)
    structured: StructuredOutput | None = None
    name: str | None = None  # the named function

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls in a finished output (None: not parseable, e.g. cut short
        by max_tokens, then it is answered as text)."""
        if self.mode == "named":
            return [self.call(self.name, text)]
        if self.mode == "auto":
            return [self.call(name, args) for name, args in split_calls(text)[1]]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [self.call(item["name"], json.dumps(item["parameters"])) for item in items]

    @staticmethod
    def call(name: str, arguments: str) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}}


def tool_plan(tools: Any, tool_choice: Any, parallel: Any,
              template: str | None = None) -> ToolPlan | None:
    """The request's tool calling, checked (400s in OpenAI's shape), or None.
    template: the chat template the prompt goes through (it decides "auto")."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if not tools:
        return None
    schemas = _functions(tools)
    if tool_choice == "none":
        return ToolPlan("none", tools)
    if tool_choice in (None, "auto"):
        if template is not None and knows_tools(template) and START not in template:
            raise APIError(400, "tool_choice \"auto\" (the default with tools) is served "
                           "for chat templates in the Hermes <tool_call> format and for "
                           "templates without tools; this model's format is not parsed "
                           "yet: pass \"required\", a named function or \"none\"",
                           "tool_choice", "unsupported_parameter")
        from xgrammar.builtin_structural_tag import get_model_structural_tag
        tag = get_model_structural_tag("qwen_3", tools=tools, tool_choice="auto",
                                       reasoning="disabled",
                                       parallel_tool_calls=parallel is not False)
        return _checked(ToolPlan("auto", tools,
                                 StructuredOutput("structural_tag", tag.model_dump_json())))
    if tool_choice == "required":
        one_of = [{"type": "object", "additionalProperties": False,
                   "required": ["name", "parameters"],
                   "properties": {"name": {"const": name}, "parameters": schema}}
                  for name, schema in schemas.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if parallel is False:
            array["maxItems"] = 1
        return _checked(ToolPlan("required", tools,
                                 StructuredOutput("json_schema", json.dumps(array))))
    name = _named(tool_choice)
    if name not in schemas:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in "
                       "tools", "tool_choice")
    return _checked(ToolPlan("named", tools,
                             StructuredOutput("json_schema", json.dumps(schemas[name])), name))


def _checked(plan: ToolPlan) -> ToolPlan:
    """400 for parameters no grammar can be made of."""
    checked(plan.structured, "tools")
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
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                       "tool_choice")
    return fn["name"]


def knows_tools(template: str) -> bool:
    return "tools" in template or "tool_calls" in template


def for_template(messages: list[dict], tools: list[dict] | None, template: str) -> list[dict]:
    """Messages a template without tool support can render (it never reads `tools`
    or `tool_calls`): the tools described in a system message, and each earlier call
    written into its assistant message as the JSON the model would have written. A
    template that knows tools gets the messages as they are."""
    if knows_tools(template):
        return messages
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            text = "\n".join(
                f"{START}\n" + json.dumps({"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"].get(
                                               "arguments"))}) + f"\n{END}"
                for c in calls)
            m = {**m, "content": ((m.get("content") or "") + "\n" + text).strip()}
            m.pop("tool_calls")
        out.append(m)
    if tools:
        listing = json.dumps([t["function"] for t in tools])
        note = {"role": "system", "content": "You can call these functions:\n" + listing
                + f"\nTo call one, write {START}\n{{\"name\": <its name>, \"arguments\": "
                f"<its arguments as JSON>}}\n{END}"}
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
