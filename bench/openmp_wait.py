"""Batch-1 decode under OpenMP wait policies (issue 52's bf16 workload a).

Between two parallel regions of a decode step (one per GEMM, per experts call, per
attention) libgomp's worker threads spin a while and then sleep on a futex; the
question is whether they sleep within a step, so that waking them hundreds of times
a step costs decode speed (perf put 20-25% of each thread's samples in libgomp,
spinning or waiting for the other). OMP_WAIT_POLICY=ACTIVE
spins for ever, so an idle server would burn its cores; this bench records that cost
too (CPU seconds a process spends in 1 s of idleness after a request), so a bounded
setting can be chosen on both counts.

libgomp reads its environment once, at load, so each variant is a process of its
own; this machine's memory bandwidth wanders by 1.5x over minutes, so variants run
one after another would measure the drift. Every variant's process is therefore
started (model loaded, graphs compiled) and kept, stopped with SIGSTOP while the
others run (a spinning worker must not take a core from them), and the generations
interleave: variant A's 1st, B's 1st, ..., A's 2nd, ... Each variant's process
loads its own copy of the model (about 6 GB for the race's bf16 one).

Finding (bench/results/openmp_wait_cpu_2026-11-28_interleaved.json, 2-core Zen 4,
bf16, 8 interleaved generations of 64 tokens): defaults 48.8 tok/s median, ACTIVE
49.3, ACTIVE with GOMP_SPINCOUNT=1e7 48.7: the wait policy does not move batch-1
decode here (ACTIVE's idle core at 100% would cost 1.0 CPU-s a second), so kvserve
leaves libgomp at its defaults. The same variants run one after another the same
day (openmp_wait_cpu_2026-11-28.json) had put ACTIVE at 1.43x: that was the drift.

    python bench/moe_checkpoint.py /tmp/moe/qwen3moe-2b
    python bench/openmp_wait.py --model /tmp/moe/qwen3moe-2b [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
VARIANTS = {"defaults": {}, "active": {"OMP_WAIT_POLICY": "ACTIVE"},
            "spin 1e7": {"GOMP_SPINCOUNT": "10000000"},
            "spin 1e9": {"GOMP_SPINCOUNT": "1000000000"},
            "active spin 3e5": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"},
            "active spin 1e7": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000000"}}


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(model: str, quantization: str, tokens: int) -> None:
    """Loads and compiles, says `ready`, then answers lines on stdin: `gen` -> the tok/s
    of one greedy batch-1 generation, `idle` -> CPU seconds burnt in 1 s of sleep."""
    import torch

    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine
    from kvserve.scheduler.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=model, dtype="bfloat16", compile="wait",
                                 quantization=quantization))
    prompt = [torch.randint(100, 40000, (128,), generator=torch.Generator().manual_seed(1))
              .tolist()]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "gen":
            start = time.perf_counter()
            engine.generate(prompt, params)
            print(round(tokens / (time.perf_counter() - start), 2), flush=True)
        elif line.strip() == "idle":
            before = _cpu_seconds()
            time.sleep(1.0)
            print(round(_cpu_seconds() - before, 3), flush=True)


def _ask(proc: subprocess.Popen, command: str) -> float:
    os.kill(proc.pid, signal.SIGCONT)
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    answer = float(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGSTOP)
    return answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8,
                    help="generations per variant, interleaved")
    ap.add_argument("--variants", default="defaults,active,active spin 1e7",
                    help=f"comma-separated, of {list(VARIANTS)}")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.quantization, args.tokens)
        return
    names = args.variants.split(",")
    base = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in names:  # one at a time: compiling takes both cores
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", "--model", args.model,
                 "--quantization", args.quantization, "--tokens", str(args.tokens)],
                env={**base, "THP_MEM_ALLOC_ENABLE": "1", **VARIANTS[name]},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"{name}: the child did not start")
            os.kill(proc.pid, signal.SIGSTOP)
            procs[name] = proc
            print(f"{name}: ready", flush=True)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            for name in names:
                rates[name].append(_ask(procs[name], "gen"))
            print(f"round {round_ + 1}: " + ", ".join(f"{n} {rates[n][-1]}" for n in names),
                  flush=True)
        idle = {name: _ask(procs[name], "idle") for name in names}
    finally:
        for proc in procs.values():
            proc.kill()
    summary = {name: {"tok_s": rates[name], "median_tok_s": statistics.median(rates[name]),
                      "idle_cpu_s_per_s": idle[name]} for name in names}
    for name, row in summary.items():
        print(f"{name:16s} median {row['median_tok_s']:6.2f} tok/s  "
              f"({row['median_tok_s'] / summary[names[0]]['median_tok_s']:.2f}x "
              f"{names[0]}), idle CPU {row['idle_cpu_s_per_s']} s/s")
    from kvserve.benchmarks.provenance import simd_flags
    from kvserve.engine.platform.device import cpu_flags

    doc = {"model": args.model, "quantization": args.quantization, "tokens": args.tokens,
           "interleaved": True, "cpu_flags": simd_flags(cpu_flags()),
           "cpus": len(os.sched_getaffinity(0)),
           "variants": {k: VARIANTS[k] for k in names}, "results": summary}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
