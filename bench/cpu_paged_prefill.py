"""kvserve::paged_prefill alone (engine/kernels/cpu/paged_prefill.cpp) against what it
replaced, the torch backend's context gathered out of the cache + torch's SDPA, calls
alternating in one process: one prompt chunk of --chunk tokens, the last of --context
positions, over the default model's 30 layers (9 query heads over 3 KV heads of 64,
blocks of 16 scattered at random, each layer's caches its own). Median ms a step.

  python bench/cpu_paged_prefill.py --dtype bfloat16 --chunk 256 --context 256
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvserve.benchmarks.provenance import simd_flags
from kvserve.engine.kernels.attention.step_metadata import context_slots
from kvserve.engine.kernels.attention.torch_backend import _prefill
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import load_once

LAYERS, BLOCK, KV_HEADS, Q_HEADS, DIM = 30, 16, 3, 9, 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = parser.parse_args(argv)
    if not 1 <= args.chunk <= args.context:
        parser.error("--chunk must be between 1 and --context")
    dtype = getattr(torch, args.dtype)
    load_once()
    torch.manual_seed(0)
    width = -(-args.context // BLOCK)
    blocks = max(64, 2 * width)
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, DIM).to(dtype),
               torch.randn(blocks, BLOCK, KV_HEADS, DIM).to(dtype)) for _ in range(LAYERS)]
    table = torch.randperm(blocks)[:width].int()
    q = torch.randn(args.chunk, Q_HEADS, DIM).to(dtype)
    scale = DIM ** -0.5
    positions = torch.arange(args.context)
    slots = context_slots(table, positions, BLOCK)
    first = args.context - args.chunk
    mask = (positions[None] <= torch.arange(first, args.context)[:, None]) if first else None

    def kernel(k_cache, v_cache):
        torch.ops.kvserve.paged_prefill(q, k_cache, v_cache, table, args.context, scale)

    def gather_sdpa(k_cache, v_cache):  # the torch backend's way (torch_backend.py)
        _prefill(q, k_cache.view(-1, KV_HEADS, DIM)[slots],
                 v_cache.view(-1, KV_HEADS, DIM)[slots], mask, scale)

    ways = {"kernel": kernel, "gather_sdpa": gather_sdpa}
    times = {name: [] for name in ways}
    for i in range(5 + args.steps):  # the first 5 warm up
        for name, way in ways.items():
            start = time.perf_counter()
            for k_cache, v_cache in caches:
                way(k_cache, v_cache)
            if i >= 5:
                times[name].append(time.perf_counter() - start)
    kernel_ms, sdpa_ms = (statistics.median(times[n]) * 1e3 for n in ("kernel", "gather_sdpa"))
    print(json.dumps({"threads": torch.get_num_threads(), "dtype": args.dtype,
                      "chunk": args.chunk, "context": args.context,
                      "step_ms": round(kernel_ms, 3), "gather_sdpa_step_ms": round(sdpa_ms, 3),
                      "kernel_speedup": round(sdpa_ms / kernel_ms, 2),
                      "cpu_flags": simd_flags(cpu_flags())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
