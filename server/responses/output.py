"""A response's output items, built from what the chat view reads off the model
(reasoning_content, content, tool_calls, in the order they come) and told as the
Responses API's events: each item added, its text or arguments in deltas, done, and
the response itself created, in progress and finally completed, incomplete or failed.

A whole (non-streamed) response is the same writer fed once, its events unsent, so
the two can never disagree."""
from __future__ import annotations

import time

from kvserve.server.responses.protocol import item_id

_TEXT = {  # item type -> (its content part, the delta / done event's name)
    "reasoning": ("reasoning_text", "response.reasoning_text"),
    "message": ("output_text", "response.output_text"),
}


class OutputWriter:
    def __init__(self, response: dict):
        """response: the envelope (id, model, the request's settings) without output."""
        self.response = {**response, "status": "in_progress", "output": [],
                         "usage": None, "error": None, "incomplete_details": None}
        self._seq = 0
        self._open: list[dict] = []  # items not done yet, in output order
        self._calls: dict[int, dict] = {}  # a chat tool call's index -> its item

    def event(self, kind: str, **fields) -> dict:
        fields = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return fields

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self._snapshot()),
                self.event("response.in_progress", response=self._snapshot())]

    def delta(self, delta: dict) -> list[dict]:
        """One chat delta ({"reasoning_content", "content", "tool_calls"}) as events."""
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finish(self, finish_reason: str | None, usage: dict | None,
               error: str | None = None) -> list[dict]:
        """Every open item done, then the response's last event."""
        cut = finish_reason not in ("stop", "tool_calls")
        events = self._close_all("incomplete" if cut else "completed")
        self.response["usage"] = usage
        if error is not None:
            self.response.update(status="failed",
                                 error={"code": "server_error", "message": error})
            kind = "response.failed"
        elif cut:
            reason = "max_output_tokens" if finish_reason == "length" else None
            self.response.update(status="incomplete", incomplete_details={"reason": reason})
            kind = "response.incomplete"
        else:
            self.response.update(status="completed", completed_at=time.time())
            kind = "response.completed"
        return events + [self.event(kind, response=self._snapshot())]

    # -- items -----------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        item = self._open[-1] if self._open else None
        if item is None or item["type"] != kind:
            events += self._close_all("completed")
            item = _new_item(kind)
            events += self._add(item)
            part_type, _ = _TEXT[kind]
            events.append(self.event("response.content_part.added", **self._where(item),
                                     part=_part(part_type, "")))
        item["content"][0]["text"] += text
        name = _TEXT[kind][1] + ".delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(name, **self._where(item), delta=text, **extra)]

    def _call(self, call: dict) -> list[dict]:
        events = []
        item = self._calls.get(call["index"])
        if item is None:
            events += self._close_all("completed")
            item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
            self._calls[call["index"]] = item
            events += self._add(item)
        arguments = call["function"].get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=item["id"], output_index=item["_index"],
                                     delta=arguments))
        return events

    def _add(self, item: dict) -> list[dict]:
        item["_index"] = len(self.response["output"])
        self.response["output"].append(item)
        self._open.append(item)
        return [self.event("response.output_item.added", output_index=item["_index"],
                           item=_public(item))]

    def _close_all(self, status: str) -> list[dict]:
        events = []
        for item in self._open:
            item["status"] = status
            where = {"item_id": item["id"], "output_index": item["_index"]}
            if item["type"] == "function_call":
                events.append(self.event("response.function_call_arguments.done", **where,
                                         name=item["name"], arguments=item["arguments"]))
            else:
                part = item["content"][0]
                extra = {"logprobs": []} if item["type"] == "message" else {}
                events.append(self.event(_TEXT[item["type"]][1] + ".done",
                                         **self._where(item), text=part["text"], **extra))
                events.append(self.event("response.content_part.done", **self._where(item),
                                         part=dict(part)))
            events.append(self.event("response.output_item.done",
                                     output_index=item["_index"], item=_public(item)))
        self._open = []
        return events

    @staticmethod
    def _where(item: dict) -> dict:
        return {"item_id": item["id"], "output_index": item["_index"], "content_index": 0}

    def _snapshot(self) -> dict:
        return {**self.response, "output": [_public(i) for i in self.response["output"]]}

    def body(self) -> dict:
        return self._snapshot()


def _new_item(kind: str) -> dict:
    part_type, _ = _TEXT[kind]
    if kind == "reasoning":
        return {"id": item_id("rs"), "type": "reasoning", "status": "in_progress",
                "summary": [], "content": [_part(part_type, "")]}
    return {"id": item_id("msg"), "type": "message", "status": "in_progress",
            "role": "assistant", "content": [_part(part_type, "")]}


def _part(kind: str, text: str) -> dict:
    if kind == "output_text":
        return {"type": kind, "text": text, "annotations": [], "logprobs": []}
    return {"type": kind, "text": text}


def _public(item: dict) -> dict:
    """The item as sent: a copy (later deltas must not change a sent event) without
    the writer's bookkeeping."""
    out = {k: v for k, v in item.items() if not k.startswith("_")}
    if "content" in out:  # an item is announced empty; its text comes in deltas
        out["content"] = ([] if item["status"] == "in_progress"
                          else [dict(p) for p in item["content"]])
    return out
