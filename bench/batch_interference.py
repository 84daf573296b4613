"""Does a batch job hurt interactive clients? (issue 55: batch lines are background
requests, "so interactive TTFT is not hurt".)

One `kvserve serve` on the default model. A probe sends one streaming chat request
at a time (a short question, 16 tokens out) and records its TTFT and inter-token
gaps, in three phases, back to back:
- idle: nothing else runs;
- batch: a /v1/batches job of LINES chat lines (long prompts, 96 tokens out each) runs,
  --batch-concurrency of them in the engine at once;
- flood: the same lines sent as ordinary requests, as many at once (what the load
  would do without background scheduling).
Reported: the probe's TTFT p50/p90 and ITL p50 per phase, each against idle, and the
lines a second the batch and the flood got through.

  python bench/batch_interference.py --json bench/results/batch_interference_DATE.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import serve_process  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
STORY = ("Write a detailed account of the history of the lighthouse on the northern "
         "cape, its keepers, the storms it saw and the ships it saved. ") * 6


def start_server(batch_dir: str, concurrency: int, extra: list[str]):
    # /ready: the compiled forward pass is built (a warming server is slower)
    return serve_process.start_server(["--batch-dir", batch_dir, "--batch-concurrency",
                                       str(concurrency), *extra], ready="/ready")


def line_body(i: int, max_tokens: int) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{i}. {STORY}"}]}


async def probe_once(c: httpx.AsyncClient, i: int) -> tuple[float, list[float]]:
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": f"Say hi, {i}."}]}
    start = time.perf_counter()
    times = []
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"]:
                    times.append(time.perf_counter())
    return times[0] - start, [b - a for a, b in zip(times, times[1:])]


async def probes(c: httpx.AsyncClient, n: int, busy=None) -> dict:
    ttft, gaps = [], []
    for i in range(n):
        if i and busy is not None and not busy():
            break  # the load ended: later probes would measure an idle server
        t, g = await probe_once(c, i)
        ttft.append(t)
        gaps += g
        await asyncio.sleep(0.2)
    q = statistics.quantiles(ttft, n=10) if len(ttft) > 1 else ttft * 9
    return {"probes": len(ttft), "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": q[8],
            "itl_p50_s": statistics.median(gaps) if gaps else None,
            "ttft_s": [round(t, 4) for t in ttft]}


async def batch_phase(c: httpx.AsyncClient, lines: int, max_tokens: int, n: int) -> dict:
    data = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST",
                               "url": "/v1/chat/completions",
                               "body": line_body(i, max_tokens)}) + "\n"
                   for i in range(lines))
    f = (await c.post("/v1/files", files={"file": ("b.jsonl", data.encode())},
                      data={"purpose": "batch"})).json()
    start = time.perf_counter()
    b = (await c.post("/v1/batches", json={"input_file_id": f["id"],
                                           "endpoint": "/v1/chat/completions"})).json()
    state = {"status": b["status"]}

    async def watch():
        while state["status"] not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(0.5)
            state.update((await c.get(f"/v1/batches/{b['id']}")).json())

    watcher = asyncio.create_task(watch())
    while state.get("request_counts", {}).get("completed", 0) < 1:
        await asyncio.sleep(0.2)  # its lines are in the engine
    result = await probes(c, n, busy=lambda: state["status"] == "in_progress")
    await watcher
    result["lines_per_s"] = state["request_counts"]["completed"] / (time.perf_counter() - start)
    result["status"] = state["status"]
    return result


async def flood_phase(c: httpx.AsyncClient, lines: int, max_tokens: int, n: int,
                      concurrency: int) -> dict:
    seats = asyncio.Semaphore(concurrency)
    done = 0

    async def one(i):
        nonlocal done
        async with seats:
            r = await c.post("/v1/chat/completions", json=line_body(i, max_tokens))
            assert r.status_code == 200, r.text
            done += 1

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(lines)]
    while done < 1:
        await asyncio.sleep(0.2)
    result = await probes(c, n, busy=lambda: done < lines)
    await asyncio.gather(*tasks)
    result["lines_per_s"] = lines / (time.perf_counter() - start)
    return result


async def run(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await probe_once(c, -1)  # warm
        idle = await probes(c, args.probes)
        batch = await batch_phase(c, args.lines, args.max_tokens, args.probes)
        flood = await flood_phase(c, args.lines, args.max_tokens, args.probes,
                                  args.concurrency)
    for phase in (batch, flood):
        phase["ttft_p50_vs_idle"] = phase["ttft_p50_s"] / idle["ttft_p50_s"]
        phase["ttft_p90_vs_idle"] = phase["ttft_p90_s"] / idle["ttft_p90_s"]
    return {"idle": idle, "batch": batch, "flood": flood}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--probes", type=int, default=15)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `kvserve serve` flag (repeat)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    from kvserve.engine.platform.device import cpu_flags

    with tempfile.TemporaryDirectory() as batch_dir:
        proc, url = start_server(batch_dir, args.concurrency, args.server_arg)
        try:
            phases = asyncio.run(run(url, args))
        finally:
            proc.terminate()
            proc.wait(60)
    result = {**provenance(None, "python bench/batch_interference.py "
                           + " ".join(argv or sys.argv[1:])),
              "cpu_flags": simd_flags(cpu_flags()), "cpus": os.cpu_count(),
              "settings": vars(args), **phases}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
