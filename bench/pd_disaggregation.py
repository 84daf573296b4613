"""Does splitting prefill from decode keep decode smooth? (issue 54 part 3: "decode
ITL p99 with disaggregation against one instance, same total cores, same run".)

The default model, behind vllm-router in both arms, back to back:
- one: one `kvserve serve` on all the cores given (--cores, default 0,1);
- pd: a prefill server (--kv-transfer-config kv_producer) on the first half of the
  cores and a decode server (kv_consumer) on the second, the router in its P/D mode
  (the pull-based hand-off; the KV moves through Mooncake's transfer engine).
The same mixed workload in each: DECODERS streaming clients generating long answers
back to back, while a long prompt (LONG_TOKENS-ish, a few tokens out) arrives every
--long-every seconds. Reported per arm: the decoders' inter-token gaps (p50, p90,
p99, the largest), the long prompts' TTFT, tokens a second; and pd against one.

  python bench/pd_disaggregation.py --json bench/results/pd_disaggregation_DATE.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_process import free_port, metric_value  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[1]
LONG_TEXT = ("The harbour master kept a ledger of every ship, its cargo, its crew and "
             "the weather on the day it came in; this is one page of it. ")


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _wait(url: str, path: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited ({proc.returncode})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise SystemExit(f"{url} not ready")


@contextlib.contextmanager
def server(cores: str, flags: list[str]):
    port = free_port()
    env = {**os.environ, "GLOG_minloglevel": "2"}
    proc = subprocess.Popen(["taskset", "-c", cores, sys.executable, "-m",
                             "kvserve.server.entrypoints.cli", "serve", "--port", str(port),
                             "--served-model-name", MODEL, *flags], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, "/ready", proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


@contextlib.contextmanager
def router(args: list[str]):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vllm_router.launch_router", *args,
                             "--host", "127.0.0.1", "--port", str(port), "--log-level",
                             "warning", "--prometheus-port", str(free_port())])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, "/health", proc, timeout=120)
        yield url
    finally:
        proc.kill()
        proc.wait()


async def decoder(c: httpx.AsyncClient, i: int, max_tokens: int, until: float,
                  gaps: list[float]) -> int:
    """Back-to-back streamed answers until `until`; their inter-token gaps."""
    tokens = 0
    n = 0
    while time.perf_counter() < until:
        body = {"model": MODEL, "prompt": f"Client {i}, answer {n}: tell a long story.",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        n += 1
        last = None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                tokens += 1
    return tokens


async def long_prompts(c: httpx.AsyncClient, every: float, repeat: int, until: float,
                       ttfts: list[float]) -> None:
    i = 0

    async def one(k: int) -> None:
        body = {"model": MODEL, "prompt": f"Page {k}. " + LONG_TEXT * repeat,
                "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        async with c.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            first = True
            async for line in r.aiter_lines():
                if line.startswith("data: {") and first:
                    ttfts.append(time.perf_counter() - t0)
                    first = False

    tasks = []
    while time.perf_counter() < until:
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(every)
    await asyncio.gather(*tasks)


async def workload(url: str, args) -> dict:
    limits = httpx.Limits(max_connections=args.decoders + 64)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "warm up",
                                                   "max_tokens": 4})
        r.raise_for_status()
        gaps: list[float] = []
        ttfts: list[float] = []
        t0 = time.perf_counter()
        until = t0 + args.seconds
        counts = await asyncio.gather(
            *(decoder(c, i, args.max_tokens, until, gaps) for i in range(args.decoders)),
            long_prompts(c, args.long_every, args.long_repeat, until, ttfts))
        wall = time.perf_counter() - t0
    tokens = sum(counts[:-1])
    return {"decode_tokens": tokens, "decode_tok_s": round(tokens / wall, 1),
            "itl_p50_ms": round(1000 * quantile(gaps, 0.5), 1),
            "itl_p90_ms": round(1000 * quantile(gaps, 0.9), 1),
            "itl_p99_ms": round(1000 * quantile(gaps, 0.99), 1),
            "itl_max_ms": round(1000 * max(gaps), 1),
            "long_prompts": len(ttfts),
            "long_ttft_p50_s": round(quantile(ttfts, 0.5), 3),
            "long_ttft_p90_s": round(quantile(ttfts, 0.9), 3)}


def server_itl(url: str) -> dict:
    """The serving instance's own inter-token latency histogram (what it sent, before
    the router and the client): p50 and p99 as bucket upper bounds."""
    text = httpx.get(url + "/metrics", timeout=10).text
    buckets = [(float(le), float(n)) for le, n in re.findall(
        r'^\S*inter_token_latency_seconds_bucket\{[^}]*le="([^"+]+)"[^}]*\} (\S+)$',
        text, re.M)]
    if not buckets or not buckets[-1][1]:
        return {}
    total = buckets[-1][1]
    at = {q: next(le for le, n in buckets if n >= q * total) for q in (0.5, 0.99)}
    return {"server_itl_p50_ms_le": 1000 * at[0.5], "server_itl_p99_ms_le": 1000 * at[0.99]}


def halves(cores: str) -> tuple[str, str]:
    ids = cores.split(",")
    if len(ids) < 2:
        raise SystemExit("--cores needs at least two cores to split")
    return ",".join(ids[:len(ids) // 2]), ",".join(ids[len(ids) // 2:])


def one_instance(args) -> dict:
    with server(args.cores, args.server_arg) as url, \
            router(["--worker-urls", url, "--policy", "round_robin"]) as front:
        out = asyncio.run(workload(front, args))
        return {**out, **server_itl(url)}


def disaggregated(args) -> dict:
    first, second = halves(args.cores)
    role = '{{"kv_connector": "MooncakeConnector", "kv_role": "{}"}}'
    with server(first, [*args.server_arg, "--kv-transfer-config",
                        role.format("kv_producer")]) as prefill, \
            server(second, [*args.server_arg, "--kv-transfer-config",
                            role.format("kv_consumer")]) as decode, \
            router(["--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                    "--kv-connector", "nixl", "--policy", "round_robin"]) as front:
        out = asyncio.run(workload(front, args))
        out.update(server_itl(decode))
        metrics = httpx.get(decode + "/metrics", timeout=10).text
    hits = metric_value(metrics, "external_prefix_cache_hits_total")
    if hits is not None:
        out["decode_tokens_from_prefill"] = int(hits)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cores", default="0,1", help="the cores both arms get in all")
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long-every", type=float, default=2.0)
    ap.add_argument("--long-repeat", type=int, default=40,
                    help="LONG_TEXT repeats in a long prompt (40: ~1100 tokens)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `kvserve serve` flag, every server (repeat)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    from kvserve.engine.platform.device import cpu_flags

    one = one_instance(args)
    pd = disaggregated(args)
    result = {**provenance(None, "python bench/pd_disaggregation.py "
                           + " ".join(argv or sys.argv[1:])),
              "cpu_flags": simd_flags(cpu_flags()), "cpus": os.cpu_count(),
              "settings": vars(args), "one_instance": one, "disaggregated": pd,
              "itl_p99_pd_over_one": round(pd["itl_p99_ms"] / one["itl_p99_ms"], 3),
              "itl_p50_pd_over_one": round(pd["itl_p50_ms"] / one["itl_p50_ms"], 3),
              "decode_tok_s_pd_over_one": round(pd["decode_tok_s"] / one["decode_tok_s"], 3)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
