"""How much of each engine step's wall time goes to waiting on the HTTP front end, at
N concurrent streaming requests.

The engine runs on a thread next to the event loop, so the front end's Python work
(SSE, JSON, detokenizing) competes with the engine's for the GIL. We run the same N
requests twice on one engine: offline (no server), then through the real server with
N streaming clients in a separate process. Over the steps where all N requests decode,
  front-end share = 1 - offline step time / server step-to-step interval,
split into the step itself running slower (GIL contention inside the step) and the
gap between steps (publishing outputs, draining commands, waiting for the GIL).

This machine has 2 cores shared by the engine, the event loop and the client process,
so the share above mixes GIL waits with plain CPU contention. The figure that carries
over to a GPU host is the front end's own CPU time per step: torch runs on one thread
(the engine thread), so process CPU time minus the engine thread's CPU time is what the
event loop spent, and under the GIL that time is taken from the engine's Python work.

Usage: python bench/frontend_wait.py [--model tiny|default|DIR] [--clients 256]
       [--max-tokens 64] [--json PATH]
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

from bench.provenance import provenance  # noqa: E402
from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from server.app import build_app  # noqa: E402
from tests.support.server import running_server  # noqa: E402

PROMPT = "The capital of France is"


class StepLog:
    """Start/end of every step in which all `width` requests decode one token."""

    def __init__(self, engine: Engine, width: int):
        self.engine, self.width, self.spans = engine, width, []
        self._step, self._schedule = engine.step, engine.scheduler.schedule
        self._last = None
        engine.scheduler.schedule = self._scheduled
        engine.step = self._timed_step

    def _scheduled(self):
        self._last = self._schedule()
        return self._last

    def _timed_step(self):
        t0 = time.perf_counter()
        outputs = self._step()
        out = self._last
        if len(out.scheduled) == self.width and out.num_batched_tokens == self.width:
            self.spans.append((t0, time.perf_counter()))
        return outputs

    def reset(self) -> None:
        self.spans = []

    def step_ms(self) -> float:
        return 1e3 * statistics.median(e - s for s, e in self.spans)

    def interval_ms(self) -> float:
        starts = [s for s, _ in self.spans]
        return 1e3 * statistics.median(b - a for a, b in zip(starts, starts[1:]))


def thread_cpu_seconds(native_id: int) -> float:
    """User + system CPU time of one thread of this process (Linux)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _model_dir(name: str) -> str:
    if name == "default":
        from engine.default_model import ensure_default_model
        return str(ensure_default_model())
    if name == "tiny":
        from tests.support.tiny_models import make_tiny_model
        return str(make_tiny_model(Path(tempfile.mkdtemp(prefix="kvserve-tiny-"))))
    return name


def _serve_and_load(engine: Engine, clients: int, max_tokens: int) -> dict:
    """Runs the clients against a server on this engine; the load they report plus
    the CPU seconds of the engine thread and of the rest of this process."""
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, ["bench"])
    with running_server(app) as url:
        tid = async_engine._thread.native_id
        cpu0, engine0 = time.process_time(), thread_cpu_seconds(tid)
        proc = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "stream_clients.py"), url,
             "--clients", str(clients), "--max-tokens", str(max_tokens),
             "--prompt", PROMPT], capture_output=True, text=True, check=True)
        engine_cpu = thread_cpu_seconds(tid) - engine0
        frontend_cpu = time.process_time() - cpu0 - engine_cpu
    load = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**load, "engine_cpu_s": engine_cpu, "frontend_cpu_s": frontend_cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)  # all engine compute on the engine thread (see above)
    model = _model_dir(args.model)
    engine = Engine(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=args.clients,
                                 max_num_batched_tokens=4096, kv_cache_memory=2 << 30))
    log = StepLog(engine, args.clients)
    prompts = [engine.tokenizer.encode(f"{i} {PROMPT}") for i in range(args.clients)]
    engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                            ignore_eos=True))
    offline_step, offline_steps = log.step_ms(), len(log.spans)
    log.reset()
    load = _serve_and_load(engine, args.clients, args.max_tokens)
    server_step, interval = log.step_ms(), log.interval_ms()
    per_token_us = 1e6 * load["frontend_cpu_s"] / (args.clients * args.max_tokens)
    result = {
        **provenance(), "model": args.model, "dtype": args.dtype, "clients": args.clients,
        "max_tokens": args.max_tokens, "client_load": load,
        "full_decode_steps": {"offline": offline_steps, "server": len(log.spans)},
        "offline_step_ms": offline_step, "server_step_ms": server_step,
        "server_step_interval_ms": interval,
        "frontend_share_of_step": 1 - offline_step / interval,
        "of_which_step_slowdown_ms": server_step - offline_step,
        "of_which_gap_between_steps_ms": interval - server_step,
        "frontend_cpu_us_per_streamed_token": per_token_us,
        "frontend_cpu_ms_per_step_at_full_width": per_token_us * args.clients / 1e3}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
