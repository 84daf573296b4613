"""What structured outputs cost (issue 19): output tok/s of N schema-constrained
requests against N free ones, in one engine, in one run, alternating; and how long
each of the ten acceptance schemas (bench/structured_schemas.py) takes to compile.

The constrained requests ask for a JSON array of many integers, so every one of
them runs to --output-len as the free ones (ignore_eos) do: both groups generate
the same number of tokens, and the ratio is the per-token cost of masking and
matching. Temperature 1, no HTTP.

  python bench/structured_overhead.py [--backend guidance] --json bench/results/...json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ of this checkout

from bench.structured_schemas import SCHEMAS  # noqa: E402
from kvserve.benchmarks.in_process.decode import where_from  # noqa: E402
from kvserve.engine.config.engine_config import EngineConfig  # noqa: E402
from kvserve.engine.core.engine import Engine  # noqa: E402
from kvserve.engine.structured.compiler import GrammarCompiler  # noqa: E402
from kvserve.modelstore.default_model import default_model_dir  # noqa: E402
from kvserve.scheduler.sampling_params import SamplingParams  # noqa: E402
from kvserve.scheduler.structured_output import StructuredOutput  # noqa: E402

LONG = StructuredOutput("json_schema", json.dumps(
    {"type": "array", "minItems": 200, "maxItems": 200,
     "items": {"type": "integer", "minimum": 0, "maximum": 999}}))


def compile_times(engine: Engine, backend: str) -> list[float]:
    """Each schema compiled by a fresh compiler (no cache), in seconds."""
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                               list(engine.eos_token_ids), backend)
    out = []
    for schema in SCHEMAS:
        t0 = time.perf_counter()
        compiler.submit(StructuredOutput("json_schema", json.dumps(schema))).result()
        out.append(time.perf_counter() - t0)
    return out


def throughput(engine: Engine, n: int, output_len: int, constrained: bool) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=1.0,
                            ignore_eos=not constrained,
                            structured=LONG if constrained else None)
    prompt = engine.tokenizer.encode("Write two hundred numbers as a JSON array:")
    t0 = time.perf_counter()
    outs = engine.generate([prompt] * n, params)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    if tokens != n * output_len:
        raise RuntimeError(f"{tokens} tokens, expected {n * output_len}")
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", default="wait", choices=["wait", "off"])
    ap.add_argument("--backend", default="xgrammar", choices=["xgrammar", "guidance"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=str(default_model_dir()), compile=args.compile,
                                 structured_outputs_backend=args.backend))
    seconds = compile_times(engine, args.backend)
    throughput(engine, 2, 8, True)  # warm-up: graphs, the long grammar compiled
    throughput(engine, 2, 8, False)
    free, constrained = [], []
    for _ in range(args.rounds):
        free.append(throughput(engine, args.requests, args.output_len, False))
        constrained.append(throughput(engine, args.requests, args.output_len, True))
    f, c = statistics.median(free), statistics.median(constrained)
    result = {**where_from(engine.device, "python bench/structured_overhead.py"),
              "dtype": str(engine.dtype).replace("torch.", ""), "backend": args.backend,
              "requests": args.requests, "output_len": args.output_len,
              "free_tok_s": free, "constrained_tok_s": constrained,
              "overhead": 1 - c / f, "compile_seconds": seconds}
    print(f"free {f:.1f} tok/s, constrained {c:.1f} tok/s: overhead {100 * (1 - c / f):.1f}%"
          f" (rounds: free {[round(x) for x in free]}, constrained "
          f"{[round(x) for x in constrained]})")
    print("compile seconds per schema: " + ", ".join(f"{s:.3f}" for s in seconds))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
