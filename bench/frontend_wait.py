"""How much of each engine step's wall time goes to waiting on the HTTP front end, at
N concurrent streaming requests, with the engine on a thread of the server process
(`--engine-mode thread`) or in a process of its own (`process`).

The same N requests run offline (no server) and then through the real server, with
N streaming clients in a separate process. Over the steps where all N requests
decode (no prompt tokens, N outputs):
  front-end share = 1 - offline step time / server step-to-step interval,
split into the step itself running slower (GIL contention inside the step) and the
gap between steps (publishing outputs, draining commands, waiting for the GIL).

This machine has 2 cores shared by the engine, the event loop and the client process,
so the share mixes GIL waits with plain CPU contention. The figure that carries over
to a GPU host is the front end's own CPU time per streamed token: torch runs on one
thread, so in thread mode process CPU minus the engine thread's CPU is what the event
loop spent, and under the GIL that time is taken from the engine's Python work.

With --threads 2 --compile wait (and --quantization) at --clients 1 it is issue 53's
workload a as served: the compiled step offline against the same step in the
server, both cores for torch, the client beside them as in bench/compare_cpu.py.

Usage: python bench/frontend_wait.py [--model tiny|default|DIR] [--clients 256]
       [--max-tokens 64] [--engine-mode thread|process] [--threads 1]
       [--quantization auto|int8|int4] [--compile off|wait] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.client.async_engine import AsyncEngine  # noqa: E402
from kvserve.engine.client.messages import StepReport  # noqa: E402
from kvserve.engine.client.process_engine import ProcessEngine  # noqa: E402
from kvserve.engine.config.engine_config import EngineConfig  # noqa: E402
from kvserve.engine.core.engine import Engine  # noqa: E402
from kvserve.engine.platform.device import cpu_flags  # noqa: E402
from kvserve.scheduler.sampling_params import SamplingParams  # noqa: E402
from kvserve.server.entrypoints.app import build_app  # noqa: E402
from tests.support.server import running_server  # noqa: E402

PROMPT = "The capital of France is"


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time of a process, or of one of its threads (Linux)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Steps:
    """(start, duration) of every full-width decode step."""

    def __init__(self, width: int):
        self.width, self.spans = width, []

    def record(self, rep: StepReport) -> None:
        if rep.step_start is not None and rep.prompt_tokens_computed == 0 \
                and len(rep.outputs) == self.width:
            self.spans.append((rep.step_start, rep.step_seconds))

    def step_ms(self) -> float:
        return 1e3 * statistics.median(d for _, d in self.spans)

    def interval_ms(self) -> float:
        starts = [s for s, _ in self.spans]
        return 1e3 * statistics.median(b - a for a, b in zip(starts, starts[1:]))


def offline_steps(engine: Engine, prompts: list[list[int]], max_tokens: int) -> Steps:
    steps, step = Steps(len(prompts)), engine.step

    def timed():
        computed, t0 = engine.counters.prompt_tokens_computed, time.monotonic()
        outs = step()
        steps.record(StepReport(outputs=outs, step_start=t0,
                                step_seconds=time.monotonic() - t0,
                                prompt_tokens_computed=engine.counters.prompt_tokens_computed
                                - computed))
        return outs

    engine.step = timed
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                            ignore_eos=True))
    del engine.step
    return steps


def serve_and_load(client, clients: int, max_tokens: int) -> tuple[dict, Steps]:
    """Runs the clients against a server on this engine client; the load they report
    plus CPU seconds of the engine and of the front end, and the engine's steps."""
    steps = Steps(clients)
    client.report_listeners.append(steps.record)
    with running_server(build_app(client, ["bench"])) as url:
        engine_cpu = _engine_cpu(client)
        cpu0, engine0 = time.process_time(), engine_cpu()
        proc = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "stream_clients.py"), url,
             "--clients", str(clients), "--max-tokens", str(max_tokens),
             "--prompt", PROMPT], capture_output=True, text=True, check=True)
        engine_s = engine_cpu() - engine0
        process_s = time.process_time() - cpu0
    in_process = isinstance(client, AsyncEngine)
    load = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**load, "engine_cpu_s": engine_s,
            "frontend_cpu_s": process_s - engine_s if in_process else process_s}, steps


def _engine_cpu(client):
    if isinstance(client, AsyncEngine):
        return lambda: cpu_seconds(os.getpid(), client._thread.native_id)
    return lambda: cpu_seconds(client._process.pid)


def _model_dir(name: str) -> str:
    if name == "default":
        from kvserve.modelstore.default_model import ensure_default_model
        return str(ensure_default_model())
    if name == "tiny":
        from tests.support.tiny_models import make_tiny_model
        return str(make_tiny_model(Path(tempfile.mkdtemp(prefix="kvserve-tiny-"))))
    return name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engine-mode", choices=["thread", "process"], default="thread")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's threads (1: the front end's CPU is the process's "
                    "minus the engine thread's, as above)")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--compile", choices=["off", "wait"], default="off")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.threads > 1 and args.engine_mode == "thread":
        # torch's worker threads would then count as the front end's CPU time.
        ap.error("--threads > 1 needs --engine-mode process")
    import torch
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # and in a spawned engine process
    config = EngineConfig(model=_model_dir(args.model), dtype=args.dtype,
                          max_num_seqs=args.clients, max_num_batched_tokens=4096,
                          kv_cache_memory=2 << 30, quantization=args.quantization,
                          compile=args.compile)
    engine = Engine(config)
    prompts = [engine.tokenizer.encode(f"{i} {PROMPT}") for i in range(args.clients)]
    offline = offline_steps(engine, prompts, args.max_tokens)
    client = AsyncEngine(engine) if args.engine_mode == "thread" else \
        ProcessEngine(config, engine.tokenizer)
    load, server = serve_and_load(client, args.clients, args.max_tokens)
    report(args, load, offline, server)


def report(args, load: dict, offline: Steps, server: Steps) -> None:
    per_token_us = 1e6 * load["frontend_cpu_s"] / (args.clients * args.max_tokens)
    interval = server.interval_ms()
    result = {
        **provenance(), "model": args.model, "dtype": args.dtype, "clients": args.clients,
        "max_tokens": args.max_tokens, "engine_mode": args.engine_mode,
        "threads": args.threads, "quantization": args.quantization,
        "compile": args.compile, "simd_flags": simd_flags(cpu_flags()),
        "client_load": load,
        "full_decode_steps": {"offline": len(offline.spans), "server": len(server.spans)},
        "offline_step_ms": offline.step_ms(), "server_step_ms": server.step_ms(),
        "server_step_interval_ms": interval,
        "frontend_share_of_step": 1 - offline.step_ms() / interval,
        "of_which_step_slowdown_ms": server.step_ms() - offline.step_ms(),
        "of_which_gap_between_steps_ms": interval - server.step_ms(),
        "frontend_cpu_us_per_streamed_token": per_token_us,
        "frontend_cpu_ms_per_step_at_full_width": per_token_us * args.clients / 1e3}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
