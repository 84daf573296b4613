"""An Anthropic conversation in chat terms: `system` becomes a system message, each
turn's content blocks the chat messages the chat route reads (text, tool_use as an
assistant's tool_calls, tool_result as a tool message, thinking as the assistant's
reasoning_content), and custom tools, tool_choice and thinking the chat fields that
server/tools.py and the chat template already read. Blocks kvserve cannot give the
model (images, documents, search results, server tools' blocks) are a 400 naming the
block, never dropped."""
from __future__ import annotations

import json
from typing import Any

from kvserve.server.anthropic.protocol import InputMessage
from kvserve.server.errors import APIError

# Keys of a block that are hints or references, not content: accepted and ignored.
# cache_control marks a prompt-caching breakpoint; kvserve's prefix cache needs none.
IGNORED_KEYS = frozenset({"cache_control", "citations"})
# A text block's text and several blocks of one turn are joined as the chat route
# joins text parts (server/chat_template.py), so the same text is the same prompt.
JOIN = "\n"
TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control",
                       "strict", "eager_input_streaming"})
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def system_messages(system: str | list[dict] | None) -> list[dict]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _texts(system, "system", ("text",))
    return [{"role": "system", "content": text}] if text else []


def chat_messages(messages: list[InputMessage]) -> list[dict]:
    """The turns as chat messages; consecutive turns of one role are merged into one,
    as Anthropic combines them."""
    out: list[dict] = []
    for i, message in enumerate(messages):
        param = f"messages.{i}.content"
        blocks = ([{"type": "text", "text": message.content}]
                  if isinstance(message.content, str) else message.content)
        turn = (_user_turn(blocks, param) if message.role == "user"
                else _assistant_turn(blocks, param))
        for m in turn:
            _append(out, m)
    return out


def is_prefill(messages: list[InputMessage], chat: list[dict]) -> bool:
    """Whether the conversation ends in the assistant's words for the model to go on
    with (Anthropic's prefill: the answer continues that text). A last assistant turn
    with tool calls is no prefill: its calls want results first."""
    if messages[-1].role != "assistant":
        return False
    if chat[-1].get("tool_calls"):
        raise APIError(400, f"messages.{len(messages) - 1}: the conversation ends with the "
                       "assistant's tool_use blocks; send their tool_result blocks in a "
                       "user turn", "messages")
    return True


def _user_turn(blocks: list[Any], param: str) -> list[dict]:
    """Text and tool results, in their order: each tool_result a tool message."""
    out, texts = [], []

    def flush():
        if texts:
            out.append({"role": "user", "content": JOIN.join(texts)})
            texts.clear()

    for j, block in enumerate(blocks):
        where = f"{param}.{j}"
        kind = _kind(block, where)
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_result":
            flush()
            out.append(_tool_result(block, where))
        else:
            _refuse_block(kind, where, "text and tool_result")
    flush()
    return out


def _assistant_turn(blocks: list[Any], param: str) -> list[dict]:
    """One assistant message: its text, its tool_use blocks as tool_calls, its
    thinking as reasoning_content (a redacted one is opaque and is left out)."""
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        where = f"{param}.{j}"
        kind = _kind(block, where)
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
        elif kind == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise APIError(400, f"{where}.thinking must be a string", _top(where))
            thoughts.append(thought)
        elif kind != "redacted_thinking":
            _refuse_block(kind, where, "text, tool_use, thinking and redacted_thinking")
    message: dict = {"role": "assistant",
                     "content": JOIN.join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = JOIN.join(thoughts)
    return [message]


def _append(out: list[dict], m: dict) -> None:
    last = out[-1] if out else None
    if last is None or last["role"] != m["role"] or m["role"] not in ("user", "assistant"):
        out.append(m)
        return
    texts = [t for t in (last.get("content"), m.get("content")) if t]
    last["content"] = JOIN.join(texts) if texts or not (
        last.get("tool_calls") or m.get("tool_calls")) else None
    for key in ("tool_calls",):
        if m.get(key):
            last[key] = last.get(key, []) + m[key]
    if m.get("reasoning_content"):
        thought = last.get("reasoning_content")
        last["reasoning_content"] = (thought + JOIN if thought else "") + m["reasoning_content"]


def _tool_use(block: dict, where: str) -> dict:
    _only(block, {"type", "id", "name", "input"}, where)
    ident, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(ident, str) or not ident or not isinstance(name, str) or not name:
        raise APIError(400, f"{where}: a tool_use block needs a string `id` and `name`",
                       _top(where))
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.input must be an object", _top(where))
    return {"id": ident, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _tool_result(block: dict, where: str) -> dict:
    """A tool message. An error result is told to the model as such in its text (chat
    has no field for it)."""
    _only(block, {"type", "tool_use_id", "content", "is_error"}, where)
    ident = block.get("tool_use_id")
    if not isinstance(ident, str) or not ident:
        raise APIError(400, f"{where}: a tool_result block needs a string `tool_use_id`",
                       _top(where))
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = _texts(content, f"{where}.content", ("text",))
    else:
        raise APIError(400, f"{where}.content must be a string or a list of text blocks",
                       _top(where))
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise APIError(400, f"{where}.is_error must be a boolean", _top(where))
    return {"role": "tool", "tool_call_id": ident,
            "content": f"Error: {text}" if is_error else text}


def _texts(blocks: Any, where: str, kinds: tuple[str, ...]) -> str:
    if not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}.{j}")
        if kind not in kinds:
            _refuse_block(kind, f"{where}.{j}", "text")
        texts.append(_text(block, f"{where}.{j}"))
    return JOIN.join(texts)


def _text(block: dict, where: str) -> str:
    _only(block, {"type", "text"}, where)
    text = block.get("text")
    if not isinstance(text, str):
        raise APIError(400, f"{where}: a text block needs a string `text`", _top(where))
    return text


def _kind(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise APIError(400, f"{where}: each content block is an object with a `type`",
                       _top(where))
    return kind


def _only(block: dict, keys: set[str], where: str) -> None:
    extra = {k for k, v in block.items() if v is not None} - keys - IGNORED_KEYS  # null: absent
    if extra:
        raise APIError(400, f"{where}.{sorted(extra)[0]} is not supported by this server "
                       f"on a {block['type']} block", _top(where))


def _top(where: str) -> str:
    """The request field a block sits in (messages or system), for the error's param."""
    return where.split(".")[0]


def _refuse_block(kind: str, where: str, supported: str) -> None:
    raise APIError(400, f"{where}: content blocks of type {kind!r} are not supported by "
                   f"this server here (only {supported})", _top(where),
                   "unsupported_parameter")


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Custom tools ({name, description, input_schema}) in chat's shape; Anthropic's
    server tools (web search, bash, code execution, computer use ...) are refused."""
    out = []
    for i, tool in enumerate(tools or ()):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise APIError(400, f"{where} must be an object", "tools")
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            raise APIError(400, f"{where}: tools of type {kind!r} (Anthropic's server "
                           "tools) are not supported by this server; only custom tools "
                           "with an input_schema", "tools", "unsupported_parameter")
        extra = set(tool) - TOOL_KEYS
        if extra:
            raise APIError(400, f"{where}.{sorted(extra)[0]} is not supported by this "
                           "server", "tools", "unsupported_parameter")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where} needs a `name`", "tools")
        if not isinstance(schema, dict):
            raise APIError(400, f"{where}.input_schema must be a JSON schema object",
                           "tools")
        # In chat's order: a template that knows no tools is shown them as JSON
        # (server/tools.py), so the order is the prompt's.
        function = {"name": name}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice: dict | None) -> tuple[str | dict | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls). auto -> "auto", any -> "required",
    tool -> the named function, none -> "none"; each held by the chat route's grammars
    (server/tools.py)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise APIError(400, "tool_choice.disable_parallel_tool_use must be a boolean",
                       "tool_choice")
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if kind == "none":
        allowed = {"type"}
    extra = set(choice) - allowed
    if extra:
        raise APIError(400, f"tool_choice.{sorted(extra)[0]} is not a field of a "
                       f"tool_choice of type {kind!r}", "tool_choice")
    parallel = False if disable else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "tool_choice of type \"tool\" needs a `name`", "tool_choice")
        return {"type": "function", "function": {"name": name}}, None
    raise APIError(400, "tool_choice.type must be one of \"auto\", \"any\", \"tool\" or "
                   f"\"none\", got {kind!r}", "tool_choice")


def thinking_switch(thinking: dict | None) -> tuple[bool | None, bool]:
    """(enable_thinking for the chat template, None to leave it be; whether the thought
    is shown). The thought itself comes back as thinking blocks when the server
    splits reasoning (--reasoning-parser). budget_tokens is checked but not held
    apart: max_tokens caps thought and answer together."""
    if thinking is None:
        return None, True
    kind = thinking.get("type")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise APIError(400, "thinking.display must be \"summarized\" or \"omitted\"",
                       "thinking")
    if kind == "disabled":
        extra = set(thinking) - {"type"}
        if extra:
            raise APIError(400, f"thinking.{sorted(extra)[0]} is not a field of disabled "
                           "thinking", "thinking")
        return False, True
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise APIError(400, "thinking.budget_tokens must be a positive integer",
                           "thinking")
    elif kind != "adaptive":
        raise APIError(400, "thinking.type must be \"enabled\", \"adaptive\" or "
                       f"\"disabled\", got {kind!r}", "thinking")
    extra = set(thinking) - {"type", "budget_tokens", "display"}
    if extra:
        raise APIError(400, f"thinking.{sorted(extra)[0]} is not supported by this server",
                       "thinking")
    return True, display != "omitted"


def reasoning_effort(output_config: dict | None) -> str | None:
    """output_config.effort, handed to the template as chat's reasoning_effort is."""
    effort = (output_config or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise APIError(400, f"output_config.effort must be one of {', '.join(EFFORTS)}",
                       "output_config.effort")
    return effort
