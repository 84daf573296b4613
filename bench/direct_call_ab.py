"""One request's decode steps with the batch-1 graph called directly (engine/
direct_graph.py) against the same graph called through Dynamo's frame: one engine,
steps alternating between the two ways so that the host's drift weighs on both alike;
median and quartile step times, and the CPU's flags.

  python bench/direct_call_ab.py --quantization int8 --steps 800

(default: the embedded default model; bench/results/cpu_direct_call_avx2_2026-11-26.md)"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from kvserve.benchmarks.provenance import simd_flags
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.platform.device import cpu_flags
from kvserve.scheduler.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the embedded one)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=800, help="timed steps, half each way")
    args = parser.parse_args(argv)
    if args.model is None:
        from kvserve.modelstore.default_model import ensure_default_model
        args.model = str(ensure_default_model())
    engine = Engine(EngineConfig(model=args.model, device="cpu", compile="wait",
                                 load_format=args.load_format, quantization=args.quantization,
                                 enable_prefix_caching=False))
    compiled = engine.runner.compiled
    direct = compiled.direct_one
    if direct is None:
        raise SystemExit("the batch-1 graph has no direct call here (see the log)")
    prompt = [100 + i % 1000 for i in range(args.prompt_len)]
    engine.add_request("ab", prompt, SamplingParams(max_tokens=args.steps + 30, temperature=0.0,
                                                    ignore_eos=True))
    for _ in range(30):  # the prompt, then decode steps
        engine.step()
    times: dict[str, list[float]] = {"dynamo": [], "direct": []}
    for i in range(args.steps):
        way = "direct" if i % 2 else "dynamo"
        compiled.direct_one = direct if way == "direct" else None
        start = time.perf_counter()
        engine.step()
        times[way].append(time.perf_counter() - start)
    compiled.direct_one = direct
    print(json.dumps({
        **{f"{way}_step_ms": round(statistics.median(t) * 1e3, 3) for way, t in times.items()},
        **{f"{way}_p25_ms": round(statistics.quantiles(t, n=4)[0] * 1e3, 3)
           for way, t in times.items()},
        "quantization": args.quantization, "positions": [args.prompt_len + 30,
                                                         args.prompt_len + 30 + args.steps],
        "cpu_flags": simd_flags(cpu_flags())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
