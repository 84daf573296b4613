"""One line of a batch's input file: read and checked (parse_lines, on a worker
thread: a line may be megabytes of JSON), then served through the app itself
(LineDispatcher), so a line gets exactly what the same request over HTTP gets: its
validation, its limits (--max-request-body-bytes, the count caps), its errors, its
metrics and traces. The line runs as the key that created the job, as a background
request (server/background.py).

The input format is OpenAI's and vLLM's run-batch's: one JSON object a line,
{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}};
each answer is {"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}, `error` set (and `response` null) for a line that could not be
sent at all."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import httpx

from kvserve.server.auth import Principal, acting_for
from kvserve.server.background import background
from kvserve.server.batch.files import new_id
from kvserve.server.batch.jobs import ENDPOINTS
from kvserve.server.request_owners import ENGINE_ID_HEADER

MAX_LINES = 50_000  # OpenAI's limit on a batch's requests
MAX_CUSTOM_ID_CHARS = 512
# A line's wrapper (custom_id, method, url) beside its body: a line longer than the
# body limit by more than this has a body the app would refuse (413) anyway.
LINE_WRAPPER_BYTES = 4096


@dataclass
class Line:
    number: int  # 1-based, among the file's non-blank lines
    custom_id: str | None
    url: str | None = None
    body: bytes | None = None  # the request body, as JSON
    error: str | None = None  # why it cannot be sent


def parse_lines(source: BinaryIO, endpoint: str | None,
                max_body_bytes: int = 0) -> Iterator[Line]:
    """The file's lines in order, each checked: JSON, a custom_id, POST to one of
    ENDPOINTS (`endpoint`, the job's, when given), a JSON object body, no streaming.
    A line past max_body_bytes (--max-request-body-bytes; 0: no limit) and its
    wrapper is refused unparsed. Blank lines are skipped. Blocking: advance it on a
    worker thread."""
    number = 0
    for raw in source:
        if not raw.strip():
            continue
        number += 1
        if max_body_bytes and len(raw) > max_body_bytes + LINE_WRAPPER_BYTES:
            yield Line(number, None, error=f"line {number} has {len(raw)} bytes; a "
                       f"request body may have at most {max_body_bytes} "
                       "(--max-request-body-bytes)")
            continue
        yield _parse(number, raw, endpoint)


def _parse(number: int, raw: bytes, endpoint: str | None) -> Line:
    try:
        item = json.loads(raw)
    except ValueError as exc:
        return Line(number, None, error=f"line {number} is not valid JSON: {exc}")
    if not isinstance(item, dict):
        return Line(number, None, error=f"line {number} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, None, error=f"line {number}: `custom_id` must be a non-empty "
                    "string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return Line(number, custom_id[:MAX_CUSTOM_ID_CHARS],
                    error=f"line {number}: `custom_id` is longer than "
                    f"{MAX_CUSTOM_ID_CHARS} characters")
    url, body = item.get("url"), item.get("body")
    why = None
    if item.get("method", "POST") != "POST":
        why = "`method` must be POST"
    elif url not in ENDPOINTS:
        why = f"`url` must be one of {', '.join(ENDPOINTS)}"
    elif endpoint is not None and url != endpoint:
        why = f"`url` is {url}, but this batch's endpoint is {endpoint}"
    elif not isinstance(body, dict):
        why = "`body` must be a JSON object"
    elif body.get("stream"):
        why = "`body.stream` must be false: a batch's answers are not streamed"
    if why:
        return Line(number, custom_id, error=f"line {number}: {why}")
    return Line(number, custom_id, url, json.dumps(body).encode())


def failed_line(line: Line, code: str = "invalid_request",
                message: str | None = None) -> dict:
    """The answer record of a line that was never sent."""
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message or line.error, "line": line.number}}


class LineDispatcher:
    """Sends lines to the app in this process, over ASGI (httpx's transport for it):
    no socket, no key, the same routes."""

    def __init__(self, app):
        self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://kvserve-batch", timeout=None)

    async def serve(self, line: Line, owner: Principal) -> dict:
        """The answer record of a checked line (its error record if it had one)."""
        if line.error:
            return failed_line(line)
        with acting_for(owner), background():
            reply = await self._client.post(
                line.url, content=line.body, headers={"content-type": "application/json"})
        try:
            body = reply.json()
        except ValueError:
            body = {"error": {"message": reply.text[:1000], "type": "server_error"}}
        request_id = reply.headers.get(ENGINE_ID_HEADER) or new_id("req_")
        return {"id": new_id("batch_req_"), "custom_id": line.custom_id,
                "response": {"status_code": reply.status_code, "request_id": request_id,
                             "body": body},
                "error": None}

    async def close(self) -> None:
        await self._client.aclose()


def succeeded(record: dict) -> bool:
    response = record.get("response")
    return response is not None and 200 <= response["status_code"] < 300
