"""Batch-1 speed at real model sizes, without weights: a shipped preset (modelstore/presets)
with random weights, kvserve beside transformers in the same run, same dtype, same
device. The measurement is `kvserve bench decode` (bench/in_process/decode.py, whose
docstring lists the workloads); this script keeps the flags that bench/gpu_session.sh
uses, turns transformers on, and prints the result as JSON.

Runs on CPU with the tiny preset as a smoke test (what CI does):
  python bench/gpu_decode.py --preset llama-tiny --json /tmp/r.json
On a GPU: python bench/gpu_decode.py --preset llama-3.1-8b --json r.json
Same thing: kvserve bench decode --model preset:llama-3.1-8b --load-format random \
  --transformers on --json r.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.benchmarks.in_process.decode import run  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--split-decode-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="copy buffer size (default: 2048 on CUDA, 64 on CPU)")
    ap.add_argument("--matmul-size", type=int, default=None,
                    help="matmul that measures peak FLOP/s where the GPU table has no "
                    "number (default: 8192 on CUDA, 2048 on CPU)")
    ap.add_argument("--attention-backend", default=None,
                    help="kvserve's attention backend (default: the engine's own choice)")
    ap.add_argument("--transformers", default="on", choices=["on", "off"])
    ap.add_argument("--generate-batch", default="auto", choices=["auto", "on", "off"],
                    help="time transformers' generate_batch (auto: on CUDA only)")
    ap.add_argument("--compile", default="off", choices=["wait", "off"],
                    help="the Inductor-compiled forward pass, built before timing")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no compiled forward pass and no CUDA graphs")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--async-scheduling", action="store_true",
                    help="plan each step while the previous one runs on the device")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="then record this many decode steps with torch.profiler "
                    "(kvserve/benchmarks/in_process/device_profile.py)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.decode_tokens < 2 or args.split_decode_tokens < 2 or args.repeats < 1:
        ap.error("--decode-tokens and --split-decode-tokens must be >= 2, --repeats >= 1")
    args.model, args.load_format, args.seed = f"preset:{args.preset}", "random", 0
    return args


def main(argv=None) -> dict:
    result = run(parse_args(argv))
    print(json.dumps(result, indent=1), flush=True)
    return result


if __name__ == "__main__":
    main()
