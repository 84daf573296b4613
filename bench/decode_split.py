"""Where one decode step's time goes on the compiled CPU path (batch 1, or --batch
requests decoding together): the whole engine step, the forward pass (graph),
sampling, the scheduler and the batch's preparation, and inside the graph the
linear layers' and attention's custom ops (torch.profiler over the same steps); what
is left of the graph is Inductor's fused pointwise kernels (norms, rotary,
residuals) and the graph's own calls.

Weights and KV read a token over the step's time is the decode's bandwidth; compare
with bench/bandwidth.py in the same minutes. The engine compiles with --compile wait
(graph packages under $KVSERVE_CACHE, built once).

usage: python bench/decode_split.py --model /tmp/d1b [--quantization int4]
       [--quantization-group-size 32] [--dtype bfloat16] [--prompt-len 128]
       [--steps 64] [--batch 1] [--compile wait|off] [--json OUT]

At --batch N the linear layers' floor is compute, not bytes: 2 * N * parameters
FLOPs a step (reported as linear_gflop_per_step; set it against bench/cpu_gemm.py's
or bench/bandwidth.py's figures from the same minutes).

With an outside profiler: it prints "timing the steps" when the steps start, e.g.
  perf record -F 999 -p PID -- sleep 10; perf report --sort sym
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.method_timer import MethodTimer  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.config.engine_config import EngineConfig  # noqa: E402
from kvserve.engine.core.engine import Engine  # noqa: E402
from kvserve.engine.platform.device import cpu_flags  # noqa: E402
from kvserve.scheduler.sampling_params import SamplingParams  # noqa: E402


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer a step reads once: the weights (a tied
    table counted once, as one tensor's storage)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def linear_params(cfg) -> int:
    """Weights a dense model's linear layers multiply each token (the head included,
    the embedding lookup not): a step's linear FLOPs are twice this per row."""
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + cfg.vocab_size * cfg.hidden_size


def op_times(prof, steps: int) -> dict[str, float]:
    """ms a step in each custom op (self CPU time), largest first."""
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.key.startswith("kvserve::") or evt.key.startswith("aten::"):
            totals[evt.key] += evt.self_cpu_time_total / 1e3 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--quantization-group-size", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--compile", default="wait", choices=["wait", "off"],
                    help="off: the eager path (the tests' quick run)")
    ap.add_argument("--load-format", default="safetensors", choices=["safetensors", "random"],
                    help="random with --model preset:...: a preset's shape, no checkpoint")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype,
                                 max_num_seqs=max(4, args.batch),
                                 quantization=args.quantization,
                                 quantization_group_size=args.quantization_group_size,
                                 compile=args.compile, load_format=args.load_format,
                                 kv_cache_memory=1 << 30))
    params = SamplingParams(max_tokens=3 * args.steps + 16, temperature=0.0,
                            ignore_eos=True)
    for r in range(args.batch):  # distinct prompts: no prefix hits between them
        engine.add_request(f"r{r}", [100 + (i + 37 * r) % 1000 for i in range(args.prompt_len)],
                           params)
    requests = engine.scheduler.requests
    while any(r.num_output_tokens == 0 for r in requests.values()):  # every prompt in
        engine.step()
    for _ in range(8):  # a few decodes of the whole batch: every graph touched once
        engine.step()
    runner = engine.runner
    timers = {
        "forward": MethodTimer(runner.paths, ("run",)),
        "sampling_launch": MethodTimer(runner.sampler, ("launch",)),
        "sampling_finish": MethodTimer(runner.sampler, ("finish",)),
        "prepare": MethodTimer(runner, ("prepare",)),
        "scheduler": MethodTimer(engine.scheduler, ("schedule", "update")),
    }
    for t in timers.values():
        t.__enter__()
    print("timing the steps", flush=True)  # an outside profiler may attach from here
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    for t in timers.values():
        t.__exit__(None, None, None)
    split = {name: t.total_ns / args.steps / 1e6 for name, t in timers.items()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t1 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        profiled_ms = (time.perf_counter() - t1) / args.steps * 1e3
    ops = op_times(prof, args.steps)
    model_bytes = weight_bytes(runner.model)
    gflop = 2 * args.batch * linear_params(engine.model_config) / 1e9
    result = {**provenance(None), "model": args.model, "dtype": args.dtype,
              "quantization": args.quantization, "compile": args.compile,
              "quantization_group_size": args.quantization_group_size,
              "cpu_flags": simd_flags(cpu_flags()), "prompt_len": args.prompt_len, "steps": args.steps,
              "batch": args.batch,
              "step_ms": step_ms, "split_ms": split,
              "outside_forward_ms": step_ms - split["forward"],
              "profiled_step_ms": profiled_ms, "ops_ms_per_step": ops,
              "weight_bytes": model_bytes,
              "linear_gflop_per_step": gflop,
              "linear_gflop_per_s": gflop / (split["forward"] / 1e3),
              "decode_gb_per_s": model_bytes / (step_ms / 1e3) / 1e9,
              "torch_threads": torch.get_num_threads()}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
    from kvserve.engine.runner.compile_process import exit_if_compiling

    sys.stdout.flush()
    exit_if_compiling(0)
