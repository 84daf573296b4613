"""kvserve::paged_decode alone (engine/kernels/cpu/paged_decode.cpp): one decode step's
attention over the default model's 30 layers (9 query heads over 3 KV heads of 64,
blocks of 16 scattered at random over the cache), ms a step and the KV bytes it read
per second. Each layer has its caches of its own, so a step's K/V outgrow L2 as in a
real step (where the weights flush them from L3 between steps, too).

  OMP_NUM_THREADS=2 python bench/cpu_paged_decode.py --batch 1 --context 192
  python bench/cpu_paged_decode.py --dtype bfloat16 --batch 32 --context 290 --against-inductor

--against-inductor also times what the kernel replaced, the reference's ops compiled by
Inductor (engine/kernels/attention/cpu_paged.py), over the same caches, steps alternating in
this process. Compare kernels in separate processes, alternating (bench/results/
cpu_paged_decode_avx2_2026-11-26.md): one process's kernel is the one it built."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvserve.benchmarks.provenance import simd_flags
from kvserve.engine.kernels.attention.cpu_paged import paged_decode_reference
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import load_once

LAYERS, BLOCK, KV_HEADS, Q_HEADS, DIM = 30, 16, 3, 9, 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--against-inductor", action="store_true")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    load_once()
    torch.manual_seed(0)
    width = -(-args.context // BLOCK)
    blocks = max(400, args.batch * width)
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, DIM, dtype=dtype),
               torch.randn(blocks, BLOCK, KV_HEADS, DIM, dtype=dtype)) for _ in range(LAYERS)]
    tables = torch.randperm(blocks)[:args.batch * width].reshape(args.batch, width).int()
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, Q_HEADS, DIM, dtype=dtype)
    ops = {"kernel": torch.ops.kvserve.paged_decode}
    if args.against_inductor:
        # dynamic: one graph for every table width, as the engine's decode graphs have
        ops["inductor"] = torch.compile(paged_decode_reference, fullgraph=True, dynamic=True)

    def step(op) -> float:
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            op(q, k_cache, v_cache, tables, lens, DIM ** -0.5)
        return time.perf_counter() - start

    times = {name: [] for name in ops}
    for i in range(20 + args.steps):  # the first 20 warm up
        for name, op in ops.items():
            t = step(op)
            if i >= 20:
                times[name].append(t)
    kv_bytes = LAYERS * args.batch * args.context * KV_HEADS * DIM * dtype.itemsize * 2
    median = statistics.median(times["kernel"])
    result = {"threads": torch.get_num_threads(), "dtype": args.dtype, "batch": args.batch,
              "context": args.context, "step_ms": round(median * 1e3, 3),
              "min_ms": round(min(times["kernel"]) * 1e3, 3),
              "kv_gb_s": round(kv_bytes / median / 1e9, 2)}
    if args.against_inductor:
        inductor = statistics.median(times["inductor"])
        result |= {"inductor_step_ms": round(inductor * 1e3, 3),
                   "kernel_speedup": round(inductor / median, 2)}
    print(json.dumps(result | {"cpu_flags": simd_flags(cpu_flags())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
