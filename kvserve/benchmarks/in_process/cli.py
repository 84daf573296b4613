"""`kvserve bench offline|decode`: the engine in this process, no HTTP. server/entrypoints/cli.py
hands these commands' arguments here unparsed (`bench serve|plot` go to bench/client), and
imports this module only when one of them runs, so `kvserve serve` never loads it.
Torch and the engine are imported only once the arguments have parsed."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import sys

from kvserve.engine.config.engine_config import EngineConfig  # light: imports no torch
from kvserve.engine.config.settings import add_flags, from_args

TOOLS = {"offline": "engine throughput without HTTP: N requests at once to "
                    "Engine.generate",
         "decode": "batch-1 decode tok/s and MBU, prefill tok/s and MFU, prefill/decode "
                   "split of one long request",
         "spec": "batch-1 tok/s with and without speculative decoding, on an "
                 "input-grounded task and on open-ended chat",
         "profile": "where a CPU decode step's time goes (matmuls, attention gather and "
                    "compute, elementwise, dispatch, sampler, host) per dtype, batch "
                    "size and eager/compiled forward, against the bytes-read floor"}

# The engine settings every tool takes (the rest of EngineConfig's are offline's, or
# fixed by the tool: one request at a time).
MODEL_SETTINGS = {"model", "load_format", "dtype", "device", "attention_backend",
                  "enforce_eager", "compile", "seed", "quantization", "kv_cache_dtype",
                  "cpu_kernels"}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the result with device, commit and command")
    p.add_argument("--log-level", default="warning", help="debug|info|warning|error")


def add_offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128,
                   help="new tokens per request (ignore_eos)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (as `vllm bench throughput`; 0: greedy)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-len", type=int, default=1024,
                   help="prompt of the TTFT/prefill and split workloads")
    p.add_argument("--decode-tokens", type=int, default=256,
                   help="new tokens of the decode workload (128-token prompt)")
    p.add_argument("--split-decode-tokens", type=int, default=512,
                   help="new tokens of the split workload")
    p.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="copy-bandwidth buffer (default: 2048 on CUDA, 64 on CPU)")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="n of the n x n matmul that measures peak FLOP/s where the GPU "
                   "table has no number (default: 8192 on CUDA, 2048 on CPU)")
    p.add_argument("--transformers", default="off", choices=["on", "off"],
                   help="also run the workloads through transformers' generate")
    p.add_argument("--generate-batch", default="auto", choices=["auto", "on", "off"],
                   help="with --transformers on, time generate_batch (auto: CUDA only)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="plan each step while the previous one runs on the device")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="then record this many decode steps with torch.profiler: the "
                   "device's busy time, the host's share, the costliest kernels")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per step")
    p.add_argument("--draft-layers", type=int, default=0,
                   help="also time early-exit drafts from this many layers (0: skip)")
    p.add_argument("--speculative-model", default=None,
                   help="also time drafts from this model (same vocabulary)")
    p.add_argument("--output-len", type=int, default=128, help="new tokens per prompt (greedy)")
    p.add_argument("--batch-sizes", type=lambda t: [int(x) for x in t.split(",") if x],
                   default=[], help="also n-gram vs none at these batch sizes, e.g. 1,4,8,16 "
                   "(where speculation stops paying)")


def add_profile_args(p: argparse.ArgumentParser) -> None:
    def names(text):
        return [x for x in text.split(",") if x]
    p.add_argument("--dtypes", type=names, default=["float32", "bfloat16"])
    p.add_argument("--modes", type=names, default=["eager", "compiled"],
                   help="forward passes to profile: eager, compiled")
    p.add_argument("--batch-sizes", type=lambda t: [int(x) for x in names(t)],
                   default=[1, 32])
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per case")
    p.add_argument("--kernels", type=int, default=0,
                   help="also list each case's N costliest ops and compiled kernels")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve bench", description=__doc__)
    tools = parser.add_subparsers(dest="tool", required=True)
    for name, add in (("offline", add_offline_args), ("decode", add_decode_args),
                      ("spec", add_spec_args), ("profile", add_profile_args)):
        p = tools.add_parser(name, help=TOOLS[name], description=TOOLS[name])
        # offline takes every engine setting, with `kvserve serve`'s defaults
        add_flags(p, EngineConfig, only=None if name == "offline" else MODEL_SETTINGS)
        add_bench_args(p)
        add(p)
    return parser


def resolve_model(args) -> None:
    """args.model becomes a directory or preset:NAME, args.model_name what to call it;
    SystemExit with a clear message for one that cannot load."""
    from kvserve.modelstore.presets import is_preset, resolve_model_path

    if args.model is None:
        from kvserve.modelstore.default_model import (DEFAULT_MODEL_NAME, DefaultModelError,
                                                      ensure_default_model)
        try:
            args.model = str(ensure_default_model())
        except DefaultModelError as exc:
            raise SystemExit(f"kvserve: {exc}") from None
        args.model_name = DEFAULT_MODEL_NAME
        return
    args.model_name = args.model
    if not is_preset(args.model):
        if not os.path.isdir(args.model):
            raise SystemExit(f"kvserve: model directory not found: {args.model}")
        return
    try:
        resolve_model_path(args.model)
    except ValueError as exc:
        raise SystemExit(f"kvserve: {exc}") from None
    if args.load_format != "random":
        raise SystemExit(f"kvserve: {args.model} is a model shape without weights; "
                         "add --load-format random")


def _bench_compile(args) -> str:
    from kvserve.benchmarks.in_process.measure import bench_compile  # torch: only when a tool runs

    return bench_compile(args)


def offline_engine_config(args) -> EngineConfig:
    return dataclasses.replace(from_args(EngineConfig, args), compile=_bench_compile(args))


def spec_engine_config(args) -> EngineConfig:
    """Batch 1: a cache for one request, every prompt computed (no prefix caching)."""
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        load_format=args.load_format, seed=args.seed,
                        max_model_len=4096, kv_cache_memory=1 << 30, max_num_seqs=1,
                        max_num_batched_tokens=2048, enable_prefix_caching=False,
                        attention_backend=args.attention_backend,
                        enforce_eager=args.enforce_eager, compile=_bench_compile(args),
                        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                        cpu_kernels=args.cpu_kernels)


def run_tool(args, command: str) -> dict:
    if args.tool == "spec":
        from kvserve.benchmarks.in_process import spec
        from kvserve.benchmarks.in_process.decode import save

        result = spec.run(args, spec_engine_config(args), command)
        save(result, args.json)
        return result
    if args.tool == "offline":
        from kvserve.benchmarks.in_process import offline
        from kvserve.benchmarks.in_process.decode import save

        result = offline.run(args, offline_engine_config(args), command)
        save(result, args.json)
        return result
    if args.tool == "profile":
        from kvserve.benchmarks.in_process import profile
        from kvserve.benchmarks.in_process.decode import save

        result = profile.run(args, command)
        save(result, args.json)
        return result
    from kvserve.benchmarks.in_process import decode

    return decode.run(args, command)


def main(argv: list[str] | None = None) -> int:
    """`argv` without `kvserve bench`: ['decode', '--model', ...]."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # as `python -m bench.in_process.cli bench ...`
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    resolve_model(args)
    from kvserve.engine.kernels.attention import AttentionBackendError
    from kvserve.engine.config.model_config import ModelConfigError
    from kvserve.engine.weights.loader import ModelLoadError

    try:
        result = run_tool(args, "kvserve bench " + shlex.join(argv))
    except (ModelLoadError, ModelConfigError, AttentionBackendError, ValueError) as exc:
        raise SystemExit(f"kvserve: {exc}") from None
    from kvserve.benchmarks.in_process.spec import table as spec_table
    from kvserve.benchmarks.in_process.tables import decode_table, offline_table

    from kvserve.benchmarks.in_process.profile import table as profile_table

    tables = {"offline": offline_table, "decode": decode_table, "spec": spec_table,
              "profile": profile_table}
    print(tables[args.tool](result), flush=True)
    if args.json:
        print(f"result written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
