"""N concurrent streaming /v1/completions clients, run in their own process so the
load they cause does not share the server's GIL.

Usage: python bench/stream_clients.py URL --clients 256 --max-tokens 64 [--prompt TEXT]
Prints one JSON line: clients, completed, chunks, seconds."""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
from httpx_sse import EventSource


async def _one(c: httpx.AsyncClient, body: dict) -> int:
    chunks = 0
    async with c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for event in EventSource(r).aiter_sse():
            chunks += event.data.startswith("{")
    return chunks


async def run(url: str, clients: int, max_tokens: int, prompt: str, model: str | None):
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        bodies = [{"model": model, "prompt": f"{i} {prompt}", "max_tokens": max_tokens,
                   "temperature": 0, "ignore_eos": True, "stream": True}
                  for i in range(clients)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(c, b) for b in bodies), return_exceptions=True)
        seconds = time.perf_counter() - t0
    ok = [r for r in results if isinstance(r, int)]
    errors = [repr(r) for r in results if not isinstance(r, int)][:3]
    return {"clients": clients, "completed": len(ok), "chunks": sum(ok),
            "seconds": seconds, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args.url, args.clients, args.max_tokens, args.prompt,
                                     args.model))))


if __name__ == "__main__":
    main()
