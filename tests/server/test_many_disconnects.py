"""50 streaming clients hang up mid-stream while 10 others keep reading: the 50 must
be out of the engine with their blocks freed within a second, and the 10 must still
get every token."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints.app import build_app
from tests.support.http import wait_idle
from tests.support.server import running_server

MODEL = "tiny"
LEAVERS, KEEPERS = 50, 10
KEEPER_TOKENS = 120


@pytest.fixture(scope="module")
def served(tiny_engine_factory):
    engine = tiny_engine_factory("llama", max_num_seqs=64, num_kv_blocks=1024)
    with running_server(build_app(AsyncEngine(engine), [MODEL])) as url:
        yield url, engine


def _body(i: int, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": f"{i} 1 2 3 4 5 6 7 8 9 10", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def _leave_after_two_chunks(c: httpx.AsyncClient, i: int, max_tokens: int,
                                  gone: list) -> str:
    """Reads two events, notes the completion id, hangs up; returns the engine id."""
    async with c.stream("POST", "/v1/completions", json=_body(i, max_tokens)) as r:
        assert r.status_code == 200
        lines = []
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                lines.append(line)
            if len(lines) == 2:
                break
    gone.append(time.monotonic())
    rid = httpx.Response(200, content=lines[0][6:]).json()["id"]
    return f"{rid}-0"  # the engine request of the first (only) prompt


async def _read_all(c: httpx.AsyncClient, i: int) -> int:
    async with c.stream("POST", "/v1/completions", json=_body(i, KEEPER_TOKENS)) as r:
        assert r.status_code == 200
        text = ""
        async for line in r.aiter_lines():
            text += line + "\n"
    assert text.rstrip().endswith("data: [DONE]")
    return text.count('"finish_reason":"length"')


def test_fifty_disconnects_free_their_blocks_within_a_second(served):
    url, engine = served

    async def run():
        limits = httpx.Limits(max_connections=LEAVERS + KEEPERS + 5)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
            gone: list[float] = []
            keepers = [asyncio.create_task(_read_all(c, 100 + i)) for i in range(KEEPERS)]
            long = engine.max_model_len - 32  # far more than they will stay for
            ids = await asyncio.gather(*(_leave_after_two_chunks(c, i, long, gone)
                                         for i in range(LEAVERS)))
            last_gone = max(gone)
            while any(_holds(engine, rid) for rid in ids):
                assert time.monotonic() - last_gone < 1.0, [
                    rid for rid in ids if _holds(engine, rid)]
                await asyncio.sleep(0.01)
            freed_after = time.monotonic() - last_gone
            assert not all(k.done() for k in keepers), "keepers ended too soon to tell"
            return freed_after, await asyncio.gather(*keepers)

    freed_after, finished = asyncio.run(run())
    assert freed_after < 1.0
    print(f"50 disconnects: blocks back {freed_after * 1000:.0f} ms after the last hang-up")
    assert finished == [1] * KEEPERS  # every keeper got to max_tokens
    assert wait_idle(engine)


def _holds(engine, rid: str) -> bool:
    return rid in engine.scheduler.requests or bool(engine.scheduler.kv.block_table(rid))
