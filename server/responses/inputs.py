"""A Responses request's conversation and options in chat terms: its input items
(messages, function calls and their outputs, earlier reasoning) become chat messages,
its function tools, tool_choice and text.format the chat fields that the chat route
already reads (server/tools.py, server/structured_fields.py)."""
from __future__ import annotations

from typing import Any

from kvserve.server.errors import APIError

ROLES = {"user": "user", "assistant": "assistant", "system": "system",
         "developer": "system"}  # chat templates know system, not developer
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """`input` as chat messages. Consecutive function calls (and the text before them
    in one turn) become one assistant message with tool_calls, as chat has them; an
    earlier turn's reasoning rides on the assistant message that follows it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    thought = None
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise APIError(400, f"{param}.role must be one of {sorted(ROLES)}, got "
                               f"{item.get('role')!r}", param)
            message = {"role": role, "content": part_text(item.get("content"), param)}
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", param), "type": "function",
                    "function": {"name": _field(item, "name", param),
                                 "arguments": _field(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": _field(item, "call_id", param),
                       "content": part_text(item.get("output"), param)}
        elif kind == "reasoning":
            thought = "".join(p.get("text", "") for p in item.get("content") or []) or None
            continue
        else:
            raise APIError(400, f"{param}: input items of type {kind!r} are not supported "
                           "by this server (messages, function_call, function_call_output "
                           "and reasoning are)", param)
        if message["role"] == "assistant" and thought:
            message["reasoning_content"], thought = thought, None
        messages.append(message)
    return messages


def part_text(content: Any, param: str) -> str:
    """Message content: a string, or text parts (joined); images, files and audio
    are refused."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(400, f"{param}: content parts of type {kind!r} are not "
                           "supported (only text)", param)
        texts.append(part.get("text") or part.get("refusal") or "")
    return "".join(texts)


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools ({type, name, parameters, ...}) in chat's shape
    ({type, function: {...}}); OpenAI's built-in tools are refused."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"tools[{i}]: tools of type {kind!r} (OpenAI's built-in "
                           "tools) are not supported by this server; only function tools",
                           "tools", "unsupported_parameter")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(400, f"tools[{i}] needs a name", "tools")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    return out or None


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise APIError(400, f"tool_choice of type {choice.get('type')!r} is not supported by "
                   "this server (\"none\", \"auto\", \"required\" or a function are)",
                   "tool_choice", "unsupported_parameter")


def chat_response_format(text: dict | None) -> dict | None:
    """text.format in chat's response_format shape (checked by the chat route)."""
    fmt = (text or {}).get("format")
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise APIError(400, f"text.format of type {kind!r} is not supported (text, json_object "
                   "or json_schema)", "text.format")


def _field(item: dict, name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{param}.{name} must be a string", param)
    return value
