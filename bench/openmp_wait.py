"""Batch-1 decode under OpenMP wait policies (issue 52's bf16 workload a).

Between two parallel regions of a decode step (one per GEMM, per experts call, per
attention) libgomp's worker threads spin a while and then sleep on a futex; waking
one costs tens of microseconds, hundreds of times a step. Measured in process on the
race's model (bench/moe_checkpoint.py), 2-core Zen 4, bf16, compiled: 37-39 tok/s
with libgomp's defaults and 47-54 with OMP_WAIT_POLICY=ACTIVE in two rounds (the
defaults also gave 46-52 once: the machine's memory bandwidth wanders). ACTIVE spins
for ever, so an idle server would burn its cores; this bench records that cost too
(CPU seconds the process spends in 1 s of idleness after a request) so a bounded
setting can be chosen on both counts. Each variant runs in a process of its own
(libgomp reads its environment once, at load), round-robin, `--rounds` times.

    python bench/moe_checkpoint.py /tmp/moe/qwen3moe-2b
    python bench/openmp_wait.py --model /tmp/moe/qwen3moe-2b [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VARIANTS = {"defaults": {}, "active": {"OMP_WAIT_POLICY": "ACTIVE"},
            "spin 1e7": {"GOMP_SPINCOUNT": "10000000"}}


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(model: str, quantization: str, tokens: int, reps: int) -> dict:
    """tok/s of `reps` greedy batch-1 generations, then the idle CPU burn."""
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
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        engine.generate(prompt, params)
        rates.append(round(tokens / (time.perf_counter() - start), 2))
    before = _cpu_seconds()
    time.sleep(1.0)
    return {"tok_s": rates, "idle_cpu_s_per_s": round(_cpu_seconds() - before, 3),
            "threads": len(os.listdir("/proc/self/task"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {list(VARIANTS)}")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.quantization, args.tokens, args.reps)))
        return
    results: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for name in args.variants.split(","):
            env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1", **VARIANTS[name]}
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, "--model", args.model,
                 "--quantization", args.quantization, "--tokens", str(args.tokens),
                 "--reps", str(args.reps)],
                env=env, capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            results.setdefault(name, []).append(got)
            print(f"round {round_ + 1} {name:10s} tok/s {got['tok_s']} idle CPU "
                  f"{got['idle_cpu_s_per_s']} s/s", flush=True)
    from kvserve.benchmarks.provenance import simd_flags
    from kvserve.engine.platform.device import cpu_flags

    doc = {"model": args.model, "quantization": args.quantization, "tokens": args.tokens,
           "cpu_flags": simd_flags(cpu_flags()), "cpus": len(os.sched_getaffinity(0)),
           "variants": {k: VARIANTS[k] for k in results}, "results": results}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
