"""A message's content blocks, built from what the chat view reads off the model
(reasoning_content, content, tool_calls, in the order they come), told as Anthropic's
stream events: message_start and a ping; each block's content_block_start, its
text_delta / thinking_delta / input_json_delta events and content_block_stop; then
message_delta with the stop reason and usage, and message_stop.

A whole (non-streamed) message is the same writer fed once, its events unsent, so the
two can never disagree.

Thinking blocks carry an empty signature: Anthropic signs its own thoughts so that
they can be checked when sent back; kvserve reads thinking blocks sent back as plain
text, so there is nothing to sign (and no signature_delta is sent)."""
from __future__ import annotations

import json

_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


class MessageWriter:
    def __init__(self, rid: str, model: str, input_tokens: int, show_thinking: bool = True):
        """input_tokens: the prompt's, as message_start tells them (message_delta
        then tells how many of them came from the prefix cache)."""
        self.message = {"id": rid, "type": "message", "role": "assistant", "model": model,
                        "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": usage(input_tokens, 0, 0)}
        self.show_thinking = show_thinking
        self._open: int | None = None  # the index of the block not stopped yet
        self._calls: dict[int, int] = {}  # a chat tool call's index -> its block's
        self._arguments: dict[int, str] = {}  # a tool_use block's input JSON so far
        self._escapes: dict[int, StringControls] = {}  # per tool_use block

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": self._snapshot()}, {"type": "ping"}]

    def delta(self, delta: dict) -> list[dict]:
        """One chat delta ({"reasoning_content", "content", "tool_calls"}) as events."""
        events = []
        if delta.get("reasoning_content"):
            events += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finish(self, stop_reason: str, stop_sequence: str | None, use: dict) -> list[dict]:
        events = self._stop()
        self.message.update(stop_reason=stop_reason, stop_sequence=stop_sequence, usage=use)
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                          "usage": use},
                         {"type": "message_stop"}]

    def body(self) -> dict:
        return self._snapshot(final=True)

    # -- blocks ----------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        blocks = self.message["content"]
        if self._open is None or blocks[self._open]["type"] != kind:
            events += self._start(_empty(kind))
        if kind == "thinking" and not self.show_thinking:
            return events  # display "omitted": the block is there, its text is not
        blocks[self._open][kind] += text
        name, key = _DELTAS[kind]
        return events + [{"type": "content_block_delta", "index": self._open,
                          "delta": {"type": name, key: text}}]

    def _call(self, call: dict) -> list[dict]:
        events = []
        index = self._calls.get(call["index"])
        if index is None:
            name = call["function"]["name"]
            events += self._start({"type": "tool_use", "id": tool_use_id(call["id"]),
                                   "name": name, "input": {}})
            index = self._calls[call["index"]] = self._open
            self._arguments[index] = ""
            self._escapes[index] = StringControls()
        arguments = self._escapes[index].feed(call["function"].get("arguments") or "")
        if arguments:
            self._arguments[index] += arguments
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events

    def _start(self, block: dict) -> list[dict]:
        events = self._stop()
        self._open = len(self.message["content"])
        self.message["content"].append(block)
        return events + [{"type": "content_block_start", "index": self._open,
                          "content_block": dict(block)}]

    def _stop(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]

    def _snapshot(self, final: bool = False) -> dict:
        content = [dict(b) for b in self.message["content"]] if final else []
        for index, block in enumerate(content):
            if block["type"] == "tool_use":
                block["input"] = _input(self._arguments.get(index, ""))
        return {**self.message, "content": content, "usage": dict(self.message["usage"])}


class StringControls:
    """A call's arguments with each raw control character inside a JSON string written
    as its \\u escape, fed as they stream. The grammars hold calls to their schemas
    but let such characters into strings, where JSON allows them only escaped: the
    SDK's parser (and any strict one) refuses them raw, and reads the escape back as
    the same character. Outside strings there are none but whitespace, kept as is."""

    def __init__(self):
        self.in_string = self.escaped = False

    def feed(self, text: str) -> str:
        out = []
        for c in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                elif c < " ":
                    out.append(f"\\u{ord(c):04x}")
                    continue
            elif c == '"':
                self.in_string = True
            out.append(c)
        return "".join(out)


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """Anthropic's usage: input_tokens are those not read from the cache, so that the
    prompt is input_tokens + cache_read_input_tokens (+ cache_creation_input_tokens,
    always 0: kvserve's prefix cache fills as it goes, no write is asked or billed)."""
    return {"input_tokens": input_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def tool_use_id(call_id: str) -> str:
    """The chat route's call id (call_...) in Anthropic's spelling (toolu_...)."""
    return "toolu_" + call_id.removeprefix("call_")


def _empty(kind: str) -> dict:
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def _input(arguments: str) -> dict:
    """A call's arguments as its input object. The grammars make them valid JSON
    objects; a call cut short by max_tokens is not read as a call at all, so the
    empty object is only ever the answer to a call that had no arguments."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish: str | None, matched, stops: list[str],
                past_context: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason. matched: the chat delta's
    stop_reason (the stop string that ended it, or a token id); past_context: the
    request's max_tokens was more than the context leaves, so a "length" finish is the
    context's end, not max_tokens'. An abort (--request-timeout) is told as
    max_tokens: the output was cut before the model finished."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    if finish == "length":
        return ("model_context_window_exceeded" if past_context else "max_tokens"), None
    if finish == "abort":
        return "max_tokens", None
    return "end_turn", None
