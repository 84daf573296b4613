"""Where a prompt's time goes on the compiled CPU path: --prompts distinct prompts of
--prompt-len tokens (no prefix hits among them, nor with the warm-up's), each with
one output token, through the engine's own steps (its token budget, its chunks).
Reported: prompt tokens a second; the steps' split (forward pass, the batch's
preparation, the scheduler); the linear layers' MACs a second against the steps'
time; minor page faults a step (a fresh buffer past glibc's mmap threshold is
faulted in on every call); and, from torch.profiler over a second identical round,
each custom op's time a step with kvserve::packed_linear split by weight shape.

Compare the linear layers' rate with bench/quantized_rows.py's for the same shapes
(--rows 512: the default token budget's chunk) in the same minutes.

usage: python bench/prefill_split.py --model /tmp/d1b [--quantization int4]
       [--prompts 32] [--prompt-len 256] [--dtype bfloat16] [--compile wait|off]
       [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode_split import linear_params, op_times  # noqa: E402
from bench.method_timer import MethodTimer  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.config.engine_config import EngineConfig  # noqa: E402
from kvserve.engine.core.engine import Engine  # noqa: E402
from kvserve.engine.platform.device import cpu_flags  # noqa: E402
from kvserve.scheduler.sampling_params import SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def run_prompts(engine: Engine, tag: str, prompts: int, length: int,
                rng: random.Random) -> int:
    """Adds the prompts and steps until every one has finished; the steps taken."""
    vocab = engine.model_config.vocab_size
    for r in range(prompts):
        engine.add_request(f"{tag}{r}", [rng.randrange(vocab) for _ in range(length)],
                           ONE_TOKEN)
    steps = 0
    while engine.scheduler.requests:
        engine.step()
        steps += 1
    return steps


def linear_shapes(prof, steps: int) -> dict[str, float]:
    """ms a step in kvserve::packed_linear, by (rows, inputs) x panels shape."""
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages(group_by_input_shape=True):
        if evt.key == "kvserve::packed_linear" and evt.input_shapes:
            x, weight = evt.input_shapes[0], evt.input_shapes[1]
            totals[f"x {x} panels {weight}"] += evt.self_cpu_time_total / 1e3 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def timed_round(engine: Engine, args, rng: random.Random) -> dict:
    timers = {
        "forward": MethodTimer(engine.runner.paths, ("run",)),
        "prepare": MethodTimer(engine.runner, ("prepare",)),
        "scheduler": MethodTimer(engine.scheduler, ("schedule", "update")),
    }
    for t in timers.values():
        t.__enter__()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    steps = run_prompts(engine, "timed", args.prompts, args.prompt_len, rng)
    seconds = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    for t in timers.values():
        t.__exit__(None, None, None)
    tokens = args.prompts * args.prompt_len
    forward_s = timers["forward"].total_ns / 1e9
    macs = tokens * (linear_params(engine.model_config)
                     - engine.model_config.vocab_size * engine.model_config.hidden_size)
    return {"steps": steps, "seconds": seconds, "prompt_tok_per_s": tokens / seconds,
            "step_ms": seconds / steps * 1e3,
            "split_ms": {name: t.total_ns / steps / 1e6 for name, t in timers.items()},
            "page_faults_per_step": faults / steps,
            "decoder_linear_gmac_per_s_of_forward": macs / forward_s / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--quantization-group-size", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--compile", default="wait", choices=["wait", "off"])
    ap.add_argument("--load-format", default="safetensors", choices=["safetensors", "random"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, compile=args.compile,
                                 load_format=args.load_format,
                                 max_num_seqs=max(4, args.prompts),
                                 quantization=args.quantization,
                                 quantization_group_size=args.quantization_group_size))
    rng = random.Random(0)
    run_prompts(engine, "warm", 4, args.prompt_len, rng)  # every graph touched once
    result = timed_round(engine, args, rng)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        steps = run_prompts(engine, "profiled", args.prompts, args.prompt_len, rng)
    result = {**provenance(None), "model": args.model, "dtype": args.dtype,
              "quantization": args.quantization, "compile": args.compile,
              "quantization_group_size": args.quantization_group_size,
              "cpu_flags": simd_flags(cpu_flags()), "prompts": args.prompts,
              "prompt_len": args.prompt_len, **result,
              "ops_ms_per_step": op_times(prof, steps),
              "packed_linear_ms_per_step_by_shape": linear_shapes(prof, steps),
              "torch_threads": torch.get_num_threads()}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
    from kvserve.engine.runner.compile_process import exit_if_compiling

    sys.stdout.flush()
    exit_if_compiling(0)
