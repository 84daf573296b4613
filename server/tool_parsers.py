"""Tool calls in what a model wrote when it could choose (`tool_choice: "auto"`), one
parser per family's format (server/tool_formats.py picks one):
- hermes (Qwen, Hermes, and kvserve's format for templates that know no tools):
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
- llama3_json (Llama 3.1 to 3.3): {"name": "get_weather", "parameters": {"city": "Paris"}},
  several separated by ";";
- mistral: [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
  (tokenizers before v11) or [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} (v11 on).

Text outside the calls is the message's content. Streamed, text goes out as it comes
except what could be the start of a call's opening, and a call goes out whole once it
is complete: no partial markup ever reaches `content`. What never becomes a call (an
opening whose call is cut short or is not the JSON of one) is given back as text."""
from __future__ import annotations

import json

Call = tuple[str, str]  # (function name, arguments as a JSON text)


class CallStream:
    """The text/call split of one choice's output, fed as it streams. A format says
    what opens a call (`opening`) and how a call is read (`_read`)."""
    opening: str

    def __init__(self):
        self._buf = ""
        self._in_call = False  # the buffer begins with the opening
        self._after_call = False  # a call just ended: a separator may follow

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content that is final now, and the calls completed by this text."""
        self._buf += text
        content, calls = [], []
        while True:
            if not self._in_call:
                if self._after_call:
                    self._buf = self._between(self._buf)
                    self._after_call = not self._buf
                at = self._buf.find(self.opening)
                if at < 0:
                    keep = _partial_prefix(self._buf, self.opening)
                    content.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:at])
                self._buf, self._in_call = self._buf[at:], True
                continue
            read = self._read(self._buf)
            if read is None:
                break  # the call is not complete yet
            done, used = read
            if done is None:
                content.append(self._buf[:used])  # an opening, but no call: text
            calls += done or []
            self._buf, self._in_call, self._after_call = self._buf[used:], False, bool(done)
        return "".join(content), calls

    def rest(self) -> str:
        """At the end of the output: what is still held (an unfinished call), as text."""
        rest, self._buf, self._in_call, self._after_call = self._buf, "", False, False
        return rest

    def _read(self, buf: str) -> tuple[list[Call] | None, int] | None:
        """buf begins with the opening: None while the call is incomplete, else (its
        calls, or None when it is not a call after all; the characters it took)."""
        raise NotImplementedError

    def _between(self, buf: str) -> str:
        """What is left after a call, less the separator the format puts between calls."""
        return buf


class HermesStream(CallStream):
    opening, closing = "<tool_call>", "</tool_call>"

    def _read(self, buf):
        end = buf.find(self.closing)
        if end < 0:
            return None
        used = end + len(self.closing)
        call = _call(buf[len(self.opening):end].strip(), "arguments")
        return ([call] if call else None), used


class Llama3JsonStream(CallStream):
    opening = '{"name"'

    def _read(self, buf):
        end = _json_end(buf, 0)
        if end is None:
            return None
        call = _call(buf[:end], "parameters", "arguments")
        return ([call] if call else None), end

    def _between(self, buf):
        return buf.lstrip("; \n\t")


class MistralStream(CallStream):
    opening, args_mark = "[TOOL_CALLS]", "[ARGS]"

    def _read(self, buf):
        at = len(buf) - len(buf[len(self.opening):].lstrip())
        if at == len(buf):
            return None
        if buf[at] == "[":  # a JSON list of {"name", "arguments"}
            end = _json_end(buf, at)
            if end is None:
                return None
            try:
                items = json.loads(buf[at:end])
            except json.JSONDecodeError:
                return None, end
            calls = [_call(json.dumps(item), "arguments") if isinstance(item, dict) else None
                     for item in items] if isinstance(items, list) else [None]
            return (calls if calls and all(calls) else None), end
        mark = buf.find(self.args_mark, at)  # name[ARGS]{...}
        if mark < 0:
            return None
        start = mark + len(self.args_mark)
        start += len(buf[start:]) - len(buf[start:].lstrip())
        if start == len(buf):
            return None
        end = _json_end(buf, start) if buf[start] == "{" else start
        if end is None:
            return None
        name, arguments = buf[at:mark].strip(), _loads(buf[start:end])
        if not name or not isinstance(arguments, dict):
            return None, end
        return [(name, json.dumps(arguments))], end


def split_calls(stream: CallStream, text: str) -> tuple[str, list[Call]]:
    """(the content outside the calls, each call) of a whole output."""
    content, calls = stream.feed(text)
    return content + stream.rest(), calls


def _call(text: str, *argument_keys: str) -> Call | None:
    """(name, arguments JSON) of {"name": ..., <an argument key>: {...}}, else None."""
    item = _loads(text)
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = next((item[k] for k in argument_keys if k in item), {})
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments)


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _json_end(text: str, start: int) -> int | None:
    """The index just past the object or list that begins at start, None if it is
    not closed yet (brackets inside strings do not count)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _partial_prefix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
