"""Where one engine step's CPU time goes at many running requests: the KV-cache pool
(kvcache/), the scheduler around it, and the whole step (batch preparation, forward,
sampling), measured on the real engine; then the same with async scheduling, where
that host work overlaps the device's step (on CUDA; on CPU the forward pass runs on
the host, so there is nothing to overlap with).

Usage: python bench/step_overhead.py [--running 256] [--model DIR] [--dtype bfloat16]
       [--steps 20] [--async-scheduling off|on|both] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.method_timer import MethodTimer  # noqa: E402
from kvserve.benchmarks.provenance import provenance  # noqa: E402
from kvserve.engine.config.engine_config import EngineConfig  # noqa: E402
from kvserve.engine.core.engine import Engine  # noqa: E402
from kvserve.scheduler.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--load-format", default="safetensors", choices=["safetensors", "random"],
                    help="random with --model preset:llama-3.2-1b: the 1B shape, no download")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--async-scheduling", default="both", choices=["off", "on", "both"],
                    help="both: measure the synchronous step, then the overlapped one")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.model is None:
        from kvserve.modelstore.default_model import ensure_default_model
        args.model = str(ensure_default_model())
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    runs = [measure(args, overlapped) for overlapped in modes]
    result = {**provenance(runs[0].pop("device_name")), "model": args.model,
              "dtype": args.dtype, "running": args.running, **runs[0]}
    if len(runs) == 2:
        runs[1].pop("device_name")
        result["async"] = runs[1]
        # The step time async scheduling saves: host work (scheduler, batch
        # preparation, outputs) that now runs while the device computes.
        result["async_step_speedup"] = runs[0]["step_ms"] / runs[1]["step_ms"]
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


def measure(args, overlapped: bool) -> dict:
    """One engine, `args.running` requests decoding: the mean step and the time spent
    in the pool, the scheduler around it, and waiting for the step's tokens."""
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.running,
                                 max_num_batched_tokens=args.running * args.prompt_len,
                                 kv_cache_memory=4 << 30, load_format=args.load_format,
                                 device=args.device, async_scheduling=overlapped))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 5, temperature=0.0, ignore_eos=True)
    for i in range(args.running):
        prompt = [rng.randrange(100, engine.model_config.vocab_size)
                  for _ in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # all prompts in one step; from here on every step is 256 decodes
    engine.step()
    assert len(engine.scheduler.running) == args.running
    kv_methods = ("allocate_slots", "block_table", "take_copies", "free", "lookup_prefix")
    with MethodTimer(engine.scheduler.kv, kv_methods) as pool, \
            MethodTimer(engine.scheduler, ("schedule", "update")) as sched, \
            MethodTimer(engine.runner, ("finish",)) as wait, \
            MethodTimer(engine.runner, ("prepare",)) as prepare:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step = (time.perf_counter() - t0) / args.steps
    out = {"device_name": _device_name(engine.device), "async_scheduling": overlapped,
           "step_ms": step * 1e3, "pool_ms_per_step": pool.total_ns / args.steps / 1e6,
           "scheduler_ms_per_step_incl_pool": sched.total_ns / args.steps / 1e6,
           # The flat batch and its metadata (eager steps; CUDA graphs' decode steps
           # build theirs in the runner's padded path instead).
           "prepare_ms_per_step": prepare.total_ns / args.steps / 1e6,
           # Blocked on the device (the step's tokens) plus decoding them.
           "finish_ms_per_step": wait.total_ns / args.steps / 1e6}
    out["pool_share_of_step"] = out["pool_ms_per_step"] / out["step_ms"]
    out["scheduler_share_of_step"] = out["scheduler_ms_per_step_incl_pool"] / out["step_ms"]
    del engine
    return out


def _device_name(device) -> str | None:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


if __name__ == "__main__":
    main()
    # The engine compiles in the background on CPU; a compile thread still running
    # cannot be stopped, and the interpreter's teardown under it aborts ("terminate
    # called without an active exception", seen in the GPU dry run under CI's load).
    from kvserve.engine.runner.compile_process import exit_if_compiling

    sys.stdout.flush()
    exit_if_compiling(0)
