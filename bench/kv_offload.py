"""Does the second KV tier give long chats their history back? (issue 54, part 4:
"TTFT of the 20th turn of 32 concurrent 20-turn chats whose histories overflow the
first tier, with and without the second tier".)

Two `kvserve serve` runs on the default model, one after the other, the same flags
but for the tier: --num-kv-blocks small enough that the chats' histories do not all
fit, then the same with --kv-offload-bytes. CHATS chats run at once, each TURNS
turns in order (a user message of about 40 tokens, MAX_TOKENS out, the reply kept
in the history). Reported per run: TTFT p50/p90 of the last turn and of every turn,
the last turn's cached_tokens, and the ratio without / with.

  python bench/kv_offload.py --json bench/results/kv_offload_DATE.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import serve_process  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
SUBJECTS = ["lighthouses", "tides", "bread", "bees", "glaciers", "comets", "rivers",
            "volcanoes", "owls", "coral", "deserts", "bridges", "clocks", "maps"]


def user_message(chat: int, turn: int) -> str:
    subject = SUBJECTS[(chat + turn) % len(SUBJECTS)]
    return (f"Chat {chat}, question {turn}: tell me one more surprising fact about "
            f"{subject}, and say how it connects to what we discussed before, in a "
            f"short answer.")


async def one_turn(c: httpx.AsyncClient, messages: list, max_tokens: int
                   ) -> tuple[float, str, int]:
    """(TTFT in s, the reply, its cached prompt tokens)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, ttft, text, cached = time.perf_counter(), None, [], 0
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                if ttft is None:
                    ttft = time.perf_counter() - start
                text.append(chunk["choices"][0]["delta"].get("content") or "")
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0)
    return ttft, "".join(text), cached


async def one_chat(c: httpx.AsyncClient, chat: int, turns: int, max_tokens: int) -> list:
    messages, out = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": user_message(chat, turn)})
        ttft, reply, cached = await one_turn(c, messages, max_tokens)
        messages.append({"role": "assistant", "content": reply})
        out.append((ttft, cached))
    return out


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as c:
        await one_turn(c, [{"role": "user", "content": "hi"}], 2)  # warm
        t0 = time.perf_counter()
        chats = await asyncio.gather(*(one_chat(c, i, args.turns, args.max_tokens)
                                       for i in range(args.chats)))
        wall = time.perf_counter() - t0
    last = [turns[-1] for turns in chats]
    every = [ttft for turns in chats for ttft, _ in turns]
    return {"wall_s": round(wall, 1),
            "last_turn_ttft_p50_s": round(quantile([t for t, _ in last], 0.5), 3),
            "last_turn_ttft_p90_s": round(quantile([t for t, _ in last], 0.9), 3),
            "every_turn_ttft_p50_s": round(quantile(every, 0.5), 3),
            "every_turn_ttft_p90_s": round(quantile(every, 0.9), 3),
            "last_turn_cached_tokens_mean": round(statistics.mean(c for _, c in last), 1)}


def serve_and_run(flags: list[str], args) -> dict:
    proc, url = serve_process.start_server(flags, ready="/ready")
    try:
        out = asyncio.run(run(url, args))
        metrics = httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(60)
    hits = serve_process.metric_value(metrics, "external_prefix_cache_hits_total")
    if hits is not None:
        out["tier_hit_tokens"] = int(hits)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--kv-offload-bytes", default="2GiB")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `kvserve serve` flag, both runs (repeat)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    from kvserve.engine.platform.device import cpu_flags

    base = ["--num-kv-blocks", str(args.num_kv_blocks), *args.server_arg]
    without = serve_and_run(base, args)
    with_tier = serve_and_run([*base, "--kv-offload-bytes", args.kv_offload_bytes], args)
    result = {**provenance(None, "python bench/kv_offload.py " + " ".join(argv or sys.argv[1:])),
              "cpu_flags": simd_flags(cpu_flags()), "cpus": os.cpu_count(),
              "settings": vars(args), "without_tier": without, "with_tier": with_tier,
              "last_turn_ttft_p50_without_over_with": round(
                  without["last_turn_ttft_p50_s"] / with_tier["last_turn_ttft_p50_s"], 2),
              "every_turn_ttft_p50_without_over_with": round(
                  without["every_turn_ttft_p50_s"] / with_tier["every_turn_ttft_p50_s"], 2)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
