"""One batch-1 decode step's linear layers of a model shape, streamed from memory as a
step reads them: every layer's weight once, one row of x, through kvserve's op
(int4 at --group, int8 per column, or bf16 pair panels), timed over --steps steps.
Weights are random values in the packed layout (the time does not depend on them);
the whole set is far larger than the last-level cache, so each step reads DRAM.

GB/s is the weights' bytes over the step's time: compare it with bench/bandwidth.py's
read in the same minutes. To compare two commits, run each tree's copy in turn
(PYTHONPATH=<a git archive of it>), alternating, several times: one run moves by
10-20% on a shared host.

usage: python bench/decode_layers.py [--kind int4|int8|bf16] [--group 32]
       [--shape 135m|1b|3b|tiny] [--steps 40] [--threads N] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.kernels.cpu import packing  # noqa: E402
from kvserve.engine.platform.device import cpu_flags  # noqa: E402
from kvserve.engine.weights.cpu_packing import load_once  # noqa: E402

# (layers, hidden, intermediate, q + k + v outputs) of the default model
# (SmolLM2-135M), Llama-3.2-1B and -3B (tiny: the tests' quick run)
SHAPES = {"135m": (30, 576, 1536, 576 + 2 * 192), "1b": (16, 2048, 8192, 2048 + 2 * 512),
          "3b": (28, 3072, 8192, 3072 + 2 * 1024), "tiny": (2, 256, 512, 256 + 2 * 64)}


def layer_shapes(shape: str) -> list[tuple[int, int]]:
    """[(N, K)] of one decoder layer's products: q/k/v, o, gate/up, down."""
    _, hidden, inter, qkv = SHAPES[shape]
    return [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]


def packed_random(kind: str, n: int, k: int, group: int, gen: torch.Generator
                  ) -> packing.Packed:
    if kind == "int4":
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(k // group, n, generator=gen) * 0.01 + 1e-3).half()
        mins = (-torch.rand(k // group, n, generator=gen) * 0.05).half()
        return packing.pack_int4(q, scales, mins)
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        return packing.pack_int8(q, torch.rand(n, generator=gen) * 0.01)
    return packing.pack_weight(torch.randn(n, k, generator=gen).to(torch.bfloat16),
                               bf16_pairs=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", default="int4", choices=["int4", "int8", "bf16"])
    ap.add_argument("--group", type=int, default=32, help="int4: inputs a scale spans")
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from kvserve.engine.kernels.cpu.bf16_pairs import PAIRS_FLAGS, bf16_pairs_here

    if args.kind == "bf16" and not bf16_pairs_here():
        ap.error(f"--kind bf16 (pair panels) needs {', '.join(PAIRS_FLAGS)}; this CPU lacks them")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_once()
    gen = torch.Generator().manual_seed(0)
    layers = [(packing.PackedWeight(packed_random(args.kind, n, k, args.group, gen), True),
               n, k) for _ in range(SHAPES[args.shape][0]) for n, k in layer_shapes(args.shape)]
    xs = {k: torch.randn(1, k, generator=gen).to(torch.bfloat16) for _, _, k in layers}
    nbytes = sum(w.contents().nbytes for w, _, _ in layers)

    def step() -> float:
        t = time.perf_counter()
        for w, n, k in layers:
            w.product(xs[k], n, None)
        return time.perf_counter() - t

    for _ in range(3):
        step()
    times = sorted(step() for _ in range(args.steps))
    best, median = times[0], statistics.median(times)
    result = {**provenance(), "cpu_flags": simd_flags(cpu_flags()), "kind": args.kind,
              "group": args.group if args.kind == "int4" else None, "shape": args.shape,
              "threads": torch.get_num_threads(), "steps": args.steps,
              "weight_bytes": nbytes, "best_ms": best * 1e3, "median_ms": median * 1e3,
              "best_gb_per_s": nbytes / best / 1e9, "median_gb_per_s": nbytes / median / 1e9}
    print(f"{args.kind} {args.shape}: {nbytes / 1e6:.0f} MB a step, best {best * 1e3:.2f} ms "
          f"({result['best_gb_per_s']:.1f} GB/s), median {median * 1e3:.2f} ms "
          f"({result['median_gb_per_s']:.1f} GB/s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
