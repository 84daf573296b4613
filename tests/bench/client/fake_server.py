"""An in-process fake OpenAI streaming server (httpx.MockTransport) for runner tests:
it records every request body and answers with a few SSE chunks."""
from __future__ import annotations

import asyncio
import json

import httpx


def sse(*payloads) -> bytes:
    parts = [f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads]
    return "".join(parts).encode()


class FakeServer:
    def __init__(self, delay: float = 0.0, fail_when=lambda body: False):
        self.bodies: list[dict] = []
        self.delay, self.fail_when = delay, fail_when
        self.in_flight = self.most_in_flight = 0

    def answer(self, body: dict, n: int) -> bytes:
        chat = "messages" in body
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}] \
            if chat else []
        for i in range(n):
            text = f" a{len(self.bodies)}t{i}"
            chunks.append({"choices": [{"index": 0, "delta": {"content": text}}]} if chat
                          else {"choices": [{"index": 0, "text": text}]})
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        return sse(*chunks, {"choices": [], "usage": usage}, "[DONE]")

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.fail_when(body):
                return httpx.Response(500, json={"error": {"message": "boom"}})
            return httpx.Response(200, content=self.answer(body, body["max_tokens"]),
                                  headers={"content-type": "text/event-stream"})
        finally:
            self.in_flight -= 1

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle),
                                 base_url="http://fake")
