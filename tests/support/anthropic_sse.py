"""Reading /v1/messages as Anthropic's own SDK types it: streams frame by frame (the
framing checked byte for byte), bodies and errors."""
from __future__ import annotations

import json

import httpx
from anthropic.types import (Message, RawContentBlockDeltaEvent, RawContentBlockStartEvent,
                             RawContentBlockStopEvent, RawMessageDeltaEvent,
                             RawMessageStartEvent, RawMessageStopEvent)

EVENT_TYPES = {"message_start": RawMessageStartEvent, "message_delta": RawMessageDeltaEvent,
               "message_stop": RawMessageStopEvent,
               "content_block_start": RawContentBlockStartEvent,
               "content_block_delta": RawContentBlockDeltaEvent,
               "content_block_stop": RawContentBlockStopEvent}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


def frames(body: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of each `event: <type>\\ndata: <json>\\n\\n` frame; the name
    is the data's type, and nothing else is in the stream (no [DONE])."""
    assert body.endswith(b"\n\n"), body[-200:]
    out = []
    for frame in body[:-2].split(b"\n\n"):
        lines = frame.split(b"\n")
        assert len(lines) == 2, frame
        name, data = lines
        assert name.startswith(b"event: ") and data.startswith(b"data: "), frame
        event = json.loads(data[len(b"data: "):].decode())
        assert event["type"] == name[len(b"event: "):].decode(), frame
        out.append((event["type"], event))
    return out


def typed_events(body: bytes) -> list:
    """Every event of a stream validated as the SDK's own type (pings checked apart:
    the SDK's stream skips them, so they have no type there)."""
    events = []
    for kind, data in frames(body):
        if kind == "ping":
            assert data == {"type": "ping"}
            events.append(data)
            continue
        assert kind in EVENT_TYPES, data
        events.append(EVENT_TYPES[kind].model_validate(data))
    return events


def message(r: httpx.Response) -> Message:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    return Message.model_validate(r.json())


def assert_anthropic_error(r: httpx.Response, status: int, contains: str = "") -> str:
    """The response is an error in Anthropic's shape with this status; its message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == ERROR_TYPES[status], body
    message = body["error"]["message"]
    assert isinstance(message, str) and message
    assert contains in message, message
    return message
