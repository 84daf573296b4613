"""Tool calls in what a model wrote when it could choose (`tool_choice: "auto"`), in
the Hermes format that Qwen and Hermes models are trained on and that kvserve asks
of templates that know no tools:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is the message's content. Streamed, text goes out as it comes
except what could be the start of a tag, and a call goes out whole once its closing
tag is in: no partial markup ever reaches `content`."""
from __future__ import annotations

import json

START, END = "<tool_call>", "</tool_call>"


def split_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the content outside the tags, the (name, arguments JSON) of each call). A call
    left open (output cut short) stays in the content, as text."""
    stream = HermesStream()
    content, calls = stream.feed(text)
    return content + stream.rest(), calls


class HermesStream:
    def __init__(self):
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """The content that is final now, and the calls completed by this text."""
        self._buf += text
        content, calls = [], []
        while True:
            if not self._in_call:
                at = self._buf.find(START)
                if at < 0:
                    keep = _partial_prefix(self._buf, START)
                    content.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:at])
                self._buf, self._in_call = self._buf[at + len(START):], True
            else:
                end = self._buf.find(END)
                if end < 0:
                    break
                calls.append(_call(self._buf[:end]))
                self._buf, self._in_call = self._buf[end + len(END):], False
        return "".join(content), calls

    def rest(self) -> str:
        """At the end of the output: what is still held (an unclosed call, as text)."""
        rest = (START if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return rest


def _partial_prefix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call(body: str) -> tuple[str, str]:
    item = json.loads(body)  # the grammar wrote it: valid by construction
    return item["name"], json.dumps(item.get("arguments", {}))
