"""Hostile requests against a running server beside normal load (issue 50).

16 streaming clients generate the whole time while /health is probed every 50 ms
(from a process of its own: bench/health_probe.py);
in the attack rounds, attackers fire bench/abuse_corpus.py's requests (huge n x
prompts, giant logit_bias, 100k stop strings, deep JSON, deep schemas, thousands of
tools, long choice lists, a regex bomb, huge /tokenize with and without a key,
huge metadata, another tenant's stored response, a slowloris body) over and over.
Quiet and attack rounds alternate, so the host's noise falls on both. Reported: the
streams' inter-token gaps (p50, p99) in each, the worst /health latency in each,
every attack's answers, any 5xx, and the requests still running and the KV cache in
use once everything has ended (a leaked block shows there).

Targets (issue 50): p99 ITL under attack within 1.5x of quiet, /health under 100 ms,
no 5xx, nothing left running.

  python bench/abuse.py --json bench/results/abuse_cpu_DATE.json
      # starts `kvserve serve` on the default model with two keys and an admin key
  python bench/abuse.py --url http://host:8000 --key K --other-key K2 --admin-key A
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import serve_process  # noqa: E402
from bench.abuse_corpus import CORPUS  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.platform.device import cpu_flags  # noqa: E402

KEYS = ("abuse-tenant-a", "abuse-tenant-b", "abuse-admin")


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    return serve_process.start_server(["--api-key", f"{KEYS[0]},{KEYS[1]}",
                                       "--admin-api-key", KEYS[2], *extra])


async def stream_forever(c: httpx.AsyncClient, ctx: dict, i: int, gaps: list, stop):
    body = {"model": ctx["model"], "prompt": f"{i} Tell me a story about the sea.",
            "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        last = None
        async with c.stream("POST", "/v1/completions", json=body, headers=ctx["auth"]) as r:
            if r.status_code != 200:
                ctx["stream_errors"].append(r.status_code)
                await asyncio.sleep(0.5)
                continue
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now


class HealthProbe:
    """bench/health_probe.py in a process of its own for the whole run; each round
    takes the probes sent inside its window."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name(
            "health_probe.py")), url], stdout=subprocess.PIPE, text=True)
        self.rows: list[tuple[float, float]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            start, seconds = line.split()
            self.rows.append((float(start), float(seconds)))

    def between(self, t0: float, t1: float) -> list[tuple[float, float]]:
        """Waits for a probe sent after t1, so a slow one sent before it is counted."""
        deadline = time.monotonic() + 120
        while not (self.rows and self.rows[-1][0] > t1) and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("the /health probe exited")
            time.sleep(0.02)
        return [(start, s) for start, s in list(self.rows) if t0 <= start <= t1]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def attack_forever(c: httpx.AsyncClient, ctx: dict, answers: dict, spans: list,
                         stop):
    """spans: (name, start, end) of each attack sent, to say what /health waited on."""
    while not stop.is_set():
        for name, attack in CORPUS.items():
            if stop.is_set():
                return
            t0 = time.monotonic()  # the probe process's clock
            try:
                status = await attack(c, ctx)
            except httpx.HTTPError as exc:
                status = f"{type(exc).__name__}"
            answers.setdefault(name, []).append(status)
            spans.append((name, t0, time.monotonic()))


async def one_round(ctx: dict, seconds: float, attack: bool, streams: int) -> dict:
    gaps, answers, spans, stop = [], {}, [], asyncio.Event()
    limits = httpx.Limits(max_connections=streams + 16)
    async with httpx.AsyncClient(base_url=ctx["url"], timeout=120, limits=limits) as c:
        tasks = [asyncio.create_task(stream_forever(c, ctx, i, gaps, stop))
                 for i in range(streams)]
        t0 = time.monotonic()
        if attack:
            tasks += [asyncio.create_task(attack_forever(c, ctx, answers, spans, stop))
                      for _ in range(ctx["attackers"])]
        await asyncio.sleep(seconds)
        stop.set()
        health = await asyncio.to_thread(ctx["probe"].between, t0, time.monotonic())
        await asyncio.wait(tasks, timeout=120)
        for t in tasks:
            t.cancel()
    q = statistics.quantiles(gaps, n=100) if len(gaps) > 100 else [float("nan")] * 99
    return {"attack": attack, "tokens": len(gaps), "itl_p50_ms": q[49] * 1e3,
            "itl_p99_ms": q[98] * 1e3,
            "health_max_ms": max((ms for _, ms in health), default=0) * 1e3,
            "health_probes": len(health), "answers": answers,
            "health_max_ms_during": health_during(health, spans)}


def health_during(health: list, spans: list) -> dict[str, float]:
    """The slowest /health probe that overlapped each kind of attack (attacks run
    four at a time, so a slow probe is counted against each one in flight)."""
    worst: dict[str, float] = {}
    for start, seconds in health:
        for name, t0, t1 in spans:
            if start <= t1 and start + seconds >= t0:
                worst[name] = max(worst.get(name, 0.0), seconds * 1e3)
    return worst


def leftovers(url: str, auth: dict) -> dict:
    time.sleep(2)  # the last aborts reach the engine
    text = httpx.get(url + "/metrics", headers=auth, timeout=30).text
    return {"running": serve_process.metric_value(text, "num_requests_running"),
            "waiting": serve_process.metric_value(text, "num_requests_waiting"),
            "kv_cache_usage": serve_process.metric_value(text, "kv_cache_usage_perc")}


def summarize(rounds: list[dict]) -> dict:
    quiet = [r for r in rounds if not r["attack"]]
    loud = [r for r in rounds if r["attack"]]
    answers: dict[str, dict] = {}
    for r in loud:
        for name, statuses in r["answers"].items():
            for status in statuses:
                answers.setdefault(name, {}).setdefault(str(status), 0)
                answers[name][str(status)] += 1
    fives = {name: {s: n for s, n in by.items() if s.startswith("5")}
             for name, by in answers.items()}
    p99 = lambda rs: statistics.median(r["itl_p99_ms"] for r in rs)  # noqa: E731
    return {"quiet_itl_p99_ms": p99(quiet), "attack_itl_p99_ms": p99(loud),
            "itl_p99_ratio": p99(loud) / p99(quiet),
            "health_max_ms": max(r["health_max_ms"] for r in rounds),
            "health_max_ms_during": {name: max(r["health_max_ms_during"].get(name, 0)
                                               for r in loud)
                                     for name in sorted({n for r in loud
                                                         for n in r["health_max_ms_during"]})},
            "answers": answers, "five_xx": {k: v for k, v in fives.items() if v}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (else one is started)")
    ap.add_argument("--key", default=KEYS[0])
    ap.add_argument("--other-key", default=KEYS[1], help="a second tenant's key")
    ap.add_argument("--admin-key", default=KEYS[2])
    ap.add_argument("--model", default=None, help="the served name (default: the first)")
    ap.add_argument("--serve-args", default="--compile off",
                    help="flags for the server this starts (default model, eager)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--attackers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=30, help="per round")
    ap.add_argument("--rounds", type=int, default=2, help="quiet/attack pairs")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    proc = probe = None
    url = args.url
    if url is None:
        proc, url = start_server(args.serve_args.split())
    try:
        auth = {"Authorization": f"Bearer {args.key}"}
        probe = HealthProbe(url)
        model = args.model or httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
        ctx = {"url": url, "model": model, "auth": auth, "attackers": args.attackers,
               "other_auth": {"Authorization": f"Bearer {args.other_key}"},
               "stream_errors": [], "probe": probe}
        rounds = []
        for _ in range(args.rounds):
            for attack in (False, True):
                rounds.append(asyncio.run(one_round(ctx, args.seconds, attack, args.streams)))
                print(json.dumps({k: v for k, v in rounds[-1].items() if k != "answers"}),
                      flush=True)
        result = {**provenance(None, "python bench/abuse.py " + " ".join(argv or sys.argv[1:])),
                  "simd_flags": simd_flags(cpu_flags()), "url_was_given": args.url is not None,
                  "serve_args": None if args.url else args.serve_args,
                  "streams": args.streams, "attackers": args.attackers,
                  "seconds_per_round": args.seconds, "rounds": rounds,
                  "stream_errors": ctx["stream_errors"],
                  "after": leftovers(url, {"Authorization": f"Bearer {args.admin_key}"}),
                  **summarize(rounds)}
    finally:
        if probe is not None:
            probe.close()
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
