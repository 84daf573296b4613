"""kvserve::paged_decode alone (engine/cpu_kernels/paged_decode.cpp): one decode step's
attention over the default model's 30 layers (9 query heads over 3 KV heads of 64,
blocks of 16 scattered at random over the cache), ms a step and the KV bytes it read
per second. Each layer has its caches of its own, so a step's K/V outgrow L2 as in a
real step (where the weights flush them from L3 between steps, too).

  OMP_NUM_THREADS=2 python bench/cpu_paged_decode.py --batch 1 --context 192

Compare kernels in separate processes, alternating (bench/results/
cpu_paged_decode_avx2_2026-11-26.md): one process's kernel is the one it built."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.cpu_kernels.setup import load_once
from bench.provenance import simd_flags
from engine.loader import cpu_flags

LAYERS, BLOCK, KV_HEADS, Q_HEADS, DIM = 30, 16, 3, 9, 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    load_once()
    torch.manual_seed(0)
    width = -(-args.context // BLOCK)
    blocks = max(400, args.batch * width)
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, DIM), torch.randn(blocks, BLOCK, KV_HEADS, DIM))
              for _ in range(LAYERS)]
    tables = torch.randperm(blocks)[:args.batch * width].reshape(args.batch, width).int()
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, Q_HEADS, DIM)
    op = torch.ops.kvserve.paged_decode

    def step() -> float:
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            op(q, k_cache, v_cache, tables, lens, DIM ** -0.5)
        return time.perf_counter() - start

    for _ in range(20):
        step()
    times = [step() for _ in range(args.steps)]
    median = statistics.median(times)
    kv_bytes = LAYERS * args.batch * args.context * KV_HEADS * DIM * 4 * 2
    print(json.dumps({"threads": torch.get_num_threads(), "batch": args.batch,
                      "context": args.context, "step_ms": round(median * 1e3, 3),
                      "min_ms": round(min(times) * 1e3, 3),
                      "kv_gb_s": round(kv_bytes / median / 1e9, 2),
                      "cpu_flags": simd_flags(cpu_flags())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
