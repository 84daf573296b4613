"""Replicas behind existing routers (from PyPI): two kvserve replicas on loopback
behind sglang-router's cache-aware policy (it matches request text) and behind
vllm-router's kv_aware policy (it reads the replicas' KV cache events, vLLM's
format) keep each shared prefix on one replica, so the prefix cache hits more,
summed over both replicas' /metrics, than the same workload round-robin; a replica
killed mid-run costs no more than its in-flight requests (the router sends the rest
to the other one)."""
from __future__ import annotations

import concurrent.futures as futures
import contextlib
import json
import random
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.server.test_ops_shutdown import serving
from tests.support.server import free_port

pytest.importorskip("sglang_router")
pytest.importorskip("vllm_router")
MODEL = "tiny"


@contextlib.contextmanager
def router(workers: list[str], policy: str, log_path, package: str = "sglang_router",
           *flags: str):
    """Yields (the router's URL, the URL of its own Prometheus metrics)."""
    port, metrics_port = free_port(), free_port()
    # no workers: the flags name them (vllm-router's --prefill / --decode)
    named = ["--worker-urls", *workers] if workers else []
    cmd = [sys.executable, "-m", f"{package}.launch_router", *named,
           "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
           # (sglang-router says warn, vllm-router warning)
           "--log-level", "warn" if package == "sglang_router" else "warning",
           "--health-check-interval-secs", "1",
           "--prometheus-port", str(metrics_port), *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if _complete(url, "ping", 1).status_code == 200:
                    break
            time.sleep(0.2)
        yield url, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        proc.kill()
        proc.wait()


def _complete(url: str, prompt: str, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _prefix_counts(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache queries, hits) in tokens, summed over the replicas."""
    queries = hits = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        queries += _counter(text, "kvserve:prefix_cache_queries_total")
        hits += _counter(text, "kvserve:prefix_cache_hits_total")
    return queries, hits


def _counter(text: str, name: str) -> float:
    """The value of series `name` (with its labels, or any labels if it names none)."""
    pattern = re.escape(name) + ("" if "{" in name else r"(?:\{[^}]*\})?")
    m = re.search(rf"^{pattern} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _workload(seed: int) -> list[str]:
    """Eight long shared system prompts, four questions each, shuffled."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "block", "cache", "token",
             "paged", "router", "replica", "prefix", "stream", "batch"]
    systems = [" ".join(rng.choice(words) for _ in range(120)) for _ in range(8)]
    prompts = [f"{s} question {q}: {rng.choice(words)}?" for s in systems for q in range(4)]
    rng.shuffle(prompts)
    return prompts


def _hit_rate(router_url: str, replicas: list[str], prompts: list[str]) -> float:
    q0, h0 = _prefix_counts(replicas)
    for p in prompts:  # one at a time: the policy, not the load, picks the replica
        r = _complete(router_url, p)
        assert r.status_code == 200, r.text
    q1, h1 = _prefix_counts(replicas)
    return (h1 - h0) / (q1 - q0)


def _events_flag(port: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://127.0.0.1:{port}", "topic": ""})


@pytest.mark.slow
def test_prefix_aware_routing_beats_round_robin_and_survives_a_replica(tiny_model_dir,
                                                                      tmp_path):
    model = tiny_model_dir("llama")
    events = [free_port(), free_port()]
    with contextlib.ExitStack() as stack:
        with futures.ThreadPoolExecutor(2) as pool:  # both start at once
            replicas = list(pool.map(lambda i: stack.enter_context(serving(
                model, tmp_path / f"replica{i}.log", "--served-model-name", MODEL,
                "--kv-events-config", _events_flag(events[i]))), range(2)))
        urls = [url for _, url in replicas]
        with router(urls, "cache_aware", tmp_path / "router-ca.log") as (url, _):
            cache_aware = _hit_rate(url, urls, _workload(1))
        with router(urls, "round_robin", tmp_path / "router-rr.log") as (url, _):
            round_robin = _hit_rate(url, urls, _workload(2))  # other prefixes: cold
        sources = [f"--kv-event-source={u}=tcp://127.0.0.1:{p}" for u, p in zip(urls, events)]
        with router(urls, "kv_aware", tmp_path / "router-kv.log", "vllm_router",
                    "--kv-event-model", MODEL, *sources) as (url, metrics):
            kv_aware = _hit_rate(url, urls, _workload(3))
            # The router's index, built from our events alone, found cached blocks
            # (without the event sources every lookup is "index_unavailable").
            own = httpx.get(metrics, timeout=10).text
            assert _counter(own, 'vllm_router_kv_placement_lookups_total{result="hit"}') > 0
        # Each shared prefix computed once rather than on both replicas.
        assert cache_aware > round_robin + 0.1, (cache_aware, round_robin)
        assert kv_aware > round_robin + 0.1, (kv_aware, round_robin)
        with router(urls, "cache_aware", tmp_path / "router-kill.log") as (url, _):
            lost, in_flight = _kill_mid_run(url, replicas[1][0], _workload(4) * 2)
        print(f"prefix-cache hit rate: cache-aware {cache_aware:.3f}, kv-aware "
              f"{kv_aware:.3f}, round-robin {round_robin:.3f}; replica killed: {lost} "
              f"lost, {in_flight} in flight")
        assert lost <= in_flight, (lost, in_flight)


def _kill_mid_run(url: str, victim: subprocess.Popen, prompts: list[str]
                  ) -> tuple[int, int]:
    """Sends prompts 8 at a time, kills the victim replica (its process tree) a third
    of the way in. Returns (requests that failed, requests in flight at the kill)."""
    concurrency = 8
    with futures.ThreadPoolExecutor(concurrency) as pool:
        jobs = [pool.submit(_complete, url, p, 8) for p in prompts]
        while sum(j.done() for j in jobs) < len(jobs) // 3:
            time.sleep(0.05)
        # At most `concurrency` requests are out at once, both replicas together.
        in_flight = min(concurrency, sum(not j.done() for j in jobs))
        for proc in [*psutil.Process(victim.pid).children(recursive=True),
                     psutil.Process(victim.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        lost = 0
        for j in jobs:
            try:
                lost += j.result().status_code != 200
            except httpx.HTTPError:
                lost += 1
    return lost, in_flight
