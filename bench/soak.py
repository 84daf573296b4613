"""Soak (issue 9): streaming requests at a fixed concurrency against a tiny random-weight
model served in this process (uvicorn on a thread, the engine on another), where a
share of the clients hang up at random moments and a share send bad requests.

Checked: every request that was neither abandoned nor bad completes with exactly
max_tokens tokens per choice (counted from the streamed token ids and from usage) and
finish reason "length"; abandoned streams and bad requests (each kind with its 4xx, in
OpenAI's error shape) cost nothing: afterwards every KV block is free and the scheduler
holds nothing. Resident memory of this process (/proc/self/statm, after gc) is taken
after each thousand requests, with the engine idle; growth from the first to the last
is what a leak would show.

Usage: python bench/soak.py [--requests 3000] [--concurrency 64] [--disconnect 0.2]
       [--bad 0.05] [--seed 0] [--json PATH]
tests/server/test_soak.py runs it (3,000 requests) in CI."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvserve.benchmarks.provenance import provenance  # noqa: E402
from tests.support.http import assert_error, parse_sse, wait_idle  # noqa: E402

MODEL = "tiny"
KEY = "soak-key"
PHASE = 1000  # RSS is taken after every PHASE requests
MIN_TOKENS, MAX_TOKENS = 8, 32
MAX_N = 4
BODY_LIMIT = 64 * 1024
REQUEST_TIMEOUT_S = 60.0  # client side: past it a request counts as hung


@dataclass
class Job:
    kind: str  # "ok", "leave" (the client hangs up) or "bad"
    path: str
    body: dict | None = None
    raw: bytes | None = None  # sent as is instead of `body`
    headers: dict = field(default_factory=dict)
    tokens: int = 0
    n: int = 1
    status: int = 200  # expected, for "bad"
    leave_after_events: int | None = None  # "leave": after this many events, or
    leave_after_s: float | None = None  # after this long, wherever it is by then


def _good(rng: random.Random, i: int) -> Job:
    tokens = rng.randint(MIN_TOKENS, MAX_TOKENS)
    n = 2 if rng.random() < 0.1 else 1
    body = {"model": MODEL, "max_tokens": tokens, "n": n, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "temperature": rng.choice([0.0, 0.7, 1.0]),
            "seed": i if rng.random() < 0.5 else None}
    if rng.random() < 0.5:
        return Job("ok", "/v1/completions", {**body, "prompt": f"request {i}: {_words(rng)}"},
                   tokens=tokens, n=n)
    messages = [{"role": "user", "content": f"request {i}: {_words(rng)}"}]
    return Job("ok", "/v1/chat/completions", {**body, "messages": messages},
               tokens=tokens, n=n)


def _words(rng: random.Random) -> str:
    return " ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(1, 24)))


def _bad(rng: random.Random, i: int) -> Job:
    cmpl = {"model": MODEL, "prompt": f"bad {i}", "max_tokens": 8, "stream": True}
    kinds = [
        ("/v1/completions", {**cmpl, "max_tokens": -1}, None, {}, 400),
        ("/v1/completions", {**cmpl, "temperature": "hot"}, None, {}, 400),
        ("/v1/completions", {**cmpl, "n": MAX_N + 1}, None, {}, 400),
        ("/v1/completions", {**cmpl, "model": "no-such-model"}, None, {}, 404),
        ("/v1/completions", {**cmpl, "prompt": [1, 10**9]}, None, {}, 400),
        ("/v1/completions", {**cmpl, "prompt": [5] * 5000}, None, {}, 400),  # > context
        ("/v1/completions", {**cmpl, "max_tokens": 10**6}, None, {}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": [], "stream": True},
         None, {}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, None, {}, 400),
        ("/v1/completions", None, b'{"prompt": "unterminated', {}, 400),
        ("/v1/completions", None, b"\xff\xfe not utf-8", {}, 400),
        ("/v1/completions", None, b"prompt=hi", {"content-type": "text/plain"}, 400),
        ("/v1/completions", cmpl, None, {"authorization": "Bearer wrong-key"}, 401),
        ("/v1/completions", cmpl, None, {"authorization": ""}, 401),
        ("/v1/completions", {**cmpl, "prompt": "x" * (BODY_LIMIT + 1)}, None, {}, 413),
        ("/v1/nope", cmpl, None, {}, 404),
    ]
    path, body, raw, headers, status = rng.choice(kinds)
    if raw is not None:
        headers = {"content-type": "application/json", **headers}
    return Job("bad", path, body, raw, headers, status=status)


def plan(count: int, seed: int, disconnect: float, bad: float) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        roll = rng.random()
        if roll < bad:
            jobs.append(_bad(rng, i))
            continue
        job = _good(rng, i)
        if roll < bad + disconnect:
            job.kind = "leave"
            if rng.random() < 0.5:  # 0: as soon as the headers are in
                job.leave_after_events = rng.randint(0, job.tokens - 1)
            else:  # maybe still waiting for the headers, maybe mid-stream, maybe done
                job.leave_after_s = rng.uniform(0.0, 0.5)
        jobs.append(job)
    return jobs


class Tally:
    def __init__(self):
        self.completed = self.aborted = self.bad = 0
        self.failures: list[str] = []


def _check_stream(job: Job, body: bytes) -> str | None:
    """None when the stream is a whole, right answer; else what is wrong."""
    try:
        chunks = parse_sse(body)
    except AssertionError as exc:
        return f"broken stream: {exc}"
    ids: dict[int, int] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks:
        if "error" in chunk:
            return f"error event: {chunk['error']}"
        for choice in chunk.get("choices", []):
            ids[choice["index"]] = ids.get(choice["index"], 0) + len(choice.get("token_ids") or [])
            if choice.get("finish_reason"):
                reasons[choice["index"]] = choice["finish_reason"]
    want = {i: job.tokens for i in range(job.n)}
    usage = chunks[-1].get("usage") or {}
    if ids != want or reasons != dict.fromkeys(range(job.n), "length") or \
            usage.get("completion_tokens") != job.tokens * job.n:
        return f"wrong answer: tokens {ids}, reasons {reasons}, usage {usage}, want {want}"
    return None


async def _one(c: httpx.AsyncClient, job: Job, tally: Tally) -> None:
    try:
        if job.kind == "bad":
            await _send_bad(c, job, tally)
        elif job.leave_after_s is not None:
            try:
                await asyncio.wait_for(_stream(c, job, tally), job.leave_after_s)
            except asyncio.TimeoutError:
                tally.aborted += 1
        else:
            await asyncio.wait_for(_stream(c, job, tally), REQUEST_TIMEOUT_S)
    except Exception as exc:  # a hang (timeout), a refused connection, a bug here
        tally.failures.append(f"{job.kind} {job.path}: {exc!r}")


async def _send_bad(c: httpx.AsyncClient, job: Job, tally: Tally) -> None:
    headers = {"authorization": f"Bearer {KEY}", **job.headers}
    kwargs = {"content": job.raw} if job.raw is not None else {"json": job.body}
    r = await c.post(job.path, headers=headers, timeout=REQUEST_TIMEOUT_S, **kwargs)
    try:
        assert_error(r, job.status)
    except AssertionError:
        tally.failures.append(f"bad {job.path}: {r.status_code} (want {job.status}) "
                              f"{r.text[:200]}")
        return
    tally.bad += 1


async def _stream(c: httpx.AsyncClient, job: Job, tally: Tally) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    async with c.stream("POST", job.path, json=job.body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            tally.failures.append(f"{job.kind} {job.path}: {r.status_code} {r.text[:200]}")
            return
        body, events = b"", 0
        async for chunk in r.aiter_raw():
            body += chunk
            events = body.count(b"\n\n")
            if job.leave_after_events is not None and events >= job.leave_after_events:
                tally.aborted += 1  # leaving the block closes the connection
                return
    problem = _check_stream(job, body)
    if problem:
        tally.failures.append(f"{job.kind} {job.path}: {problem}")
    else:
        tally.completed += 1


async def _phase(url: str, jobs: list[Job], concurrency: int, tally: Tally) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    # Pooled connections expire on the client first: uvicorn closes one idle for 5 s
    # (timeout_keep_alive), and a request sent on it at that moment fails (ReadError).
    limits = httpx.Limits(max_connections=concurrency + 8, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as c:

        async def worker():
            while not queue.empty():
                await _one(c, queue.get_nowait(), tally)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def rss_mib() -> float:
    """Resident memory of this process after a full collection (Linux)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class Target:
    url: str
    engine: object  # kvserve.engine.core.engine.Engine
    app: object


@contextlib.contextmanager
def serving(model_dir: str | Path, concurrency: int = 64):
    """A server on `model_dir` in this process, with an API key, --max-n and a body
    limit (some bad requests are judged against them)."""
    from kvserve.engine.client.async_engine import AsyncEngine
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine
    from kvserve.server.entrypoints.app import build_app
    from kvserve.server.config import ServerConfig
    from tests.support.server import running_server

    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=1024,
                                 max_num_seqs=concurrency, max_num_batched_tokens=512,
                                 max_model_len=1024))
    app = build_app(AsyncEngine(engine), [MODEL], config=ServerConfig(
        api_keys=[KEY], max_request_body_bytes=BODY_LIMIT, max_n=MAX_N))
    with running_server(app) as url:
        yield Target(url, engine, app)


def soak(target: Target, requests: int = 3000, concurrency: int = 64,
         disconnect: float = 0.2, bad: float = 0.05, seed: int = 0) -> dict:
    jobs = plan(requests, seed, disconnect, bad)
    tally = Tally()
    rss, idle_ok = {}, True
    start = time.monotonic()
    for first in range(0, requests, PHASE):
        asyncio.run(_phase(target.url, jobs[first:first + PHASE], concurrency, tally))
        idle_ok &= bool(wait_idle(target.engine, timeout=10))
        rss[str(min(first + PHASE, requests))] = round(rss_mib(), 1)
    seconds = time.monotonic() - start
    engine, sched = target.engine, target.engine.scheduler
    rss_values = list(rss.values())
    return {
        "requests": requests, "concurrency": concurrency, "disconnect_share": disconnect,
        "bad_share": bad, "seed": seed,
        "planned": {kind: sum(j.kind == kind for j in jobs) for kind in ("ok", "leave", "bad")},
        "completed": tally.completed, "aborted": tally.aborted, "bad": tally.bad,
        "failures": len(tally.failures), "failure_examples": tally.failures[:10],
        "idle_after_each_thousand": idle_ok,
        "leaked_blocks": engine.scheduler.kv.num_blocks - engine.scheduler.kv.num_free_blocks,
        "num_blocks": engine.scheduler.kv.num_blocks,
        "waiting": len(sched.waiting), "running": len(sched.running),
        "unfinished": engine.has_unfinished_requests(),
        "in_flight": target.app.state.admission.in_flight,
        "rss_mib": rss,
        "rss_growth_pct": round(100 * (rss_values[-1] - rss_values[0]) / rss_values[0], 2),
        "seconds": round(seconds, 1),
    }


def summary(r: dict) -> str:
    rss = ", ".join(f"{k}: {v:.0f} MiB" for k, v in r["rss_mib"].items())
    return (f"soak: {r['requests']} requests at {r['concurrency']} concurrency in "
            f"{r['seconds']:.0f} s: {r['completed']} completed, {r['aborted']} aborted, "
            f"{r['bad']} bad, {r['failures']} failures; leaked blocks "
            f"{r['leaked_blocks']}/{r['num_blocks']}, waiting {r['waiting']}, running "
            f"{r['running']}; RSS {rss}; growth {r['rss_growth_pct']:+.2f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.2)
    ap.add_argument("--bad", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="model directory (default: a tiny random one)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model_dir, model = args.model, args.model
    if model_dir is None:
        from tests.support.tiny_models import make_tiny_model
        model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="kvserve-tiny-")))
        model = "tiny random llama (tests/support/tiny_models.py)"
    with serving(model_dir, args.concurrency) as target:
        result = soak(target, args.requests, args.concurrency, args.disconnect, args.bad,
                      args.seed)
    print(summary(result))
    if args.json:
        result = {**provenance(), "model": model, **result}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
