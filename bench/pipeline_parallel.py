"""Do the pipeline's steps in flight overlap the stages? (issue 54, part 1: "the
scheduler keeps P batches in flight so no stage idles".)

Three engines on the default model, one after the other, the same prompts (CLIENTS
prompts of PROMPT tokens, MAX_TOKENS greedy tokens each, offline): one process;
--pipeline-parallel-size P (P steps in flight); and the same P stages with one step
in flight at a time (the engine waits for each step before it plans the next, each
step seating every request), which is what the stages would do without the
overlap. On a 2-core CPU the stages share the cores (a thread each at P=2), so the
figure to read is P in flight against one in flight: how much of the stages' idle
time the overlap takes back. Greedy outputs are checked equal across the three.

  python bench/pipeline_parallel.py --json bench/results/cpu_pipeline_DATE.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.config.engine_config import EngineConfig  # noqa: E402
from kvserve.engine.core.engine import Engine  # noqa: E402
from kvserve.modelstore.default_model import ensure_default_model  # noqa: E402
from kvserve.scheduler.sampling_params import SamplingParams  # noqa: E402


def one_run(args, pp: int, in_flight: int) -> dict:
    config = EngineConfig(model=str(ensure_default_model()), dtype=args.dtype,
                          quantization="none", compile="off", device="cpu",
                          num_kv_blocks=2048, max_num_batched_tokens=args.budget,
                          pipeline_parallel_size=pp)
    engine = Engine(config)
    try:
        if pp > 1 and in_flight != pp:  # the same stages, one step at a time
            engine.pipeline.steps_in_flight = in_flight
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config,
                                                          steps_in_flight=in_flight)
        prompts = [[(c * 131 + j * 7) % 40000 + 100 for j in range(args.prompt)]
                   for c in range(args.clients)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm
        t0 = time.perf_counter()
        tokens = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    generated = sum(map(len, tokens))
    return {"pipeline_parallel_size": pp, "steps_in_flight": in_flight, "wall_s": wall,
            "generated_tokens": generated, "tokens_per_s": generated / wall,
            "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = [one_run(args, 1, 1), one_run(args, args.pp, args.pp),
            one_run(args, args.pp, 1)]
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    for r in runs:
        del r["tokens"]
        print(f"P={r['pipeline_parallel_size']} in flight {r['steps_in_flight']}: "
              f"{r['tokens_per_s']:.1f} tok/s ({r['wall_s']:.1f} s)")
    overlap = runs[1]["tokens_per_s"] / runs[2]["tokens_per_s"]
    print(f"P={args.pp}: {overlap:.2f}x with {args.pp} steps in flight against one; "
          f"{runs[1]['tokens_per_s'] / runs[0]['tokens_per_s']:.2f}x one process; "
          f"outputs equal: {same}")
    if args.json:
        from kvserve.engine.platform.device import cpu_flags

        command = "python bench/pipeline_parallel.py " + " ".join(sys.argv[1:])
        args.json.write_text(json.dumps({
            **provenance(None, command), "cpu_flags": simd_flags(cpu_flags()),
            "cpus": os.cpu_count(), "settings": {k: str(v) for k, v in vars(args).items()},
            "runs": runs, "in_flight_over_serial": round(overlap, 2),
            "outputs_equal": same}, indent=2))


if __name__ == "__main__":
    main()
