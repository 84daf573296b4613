"""A bf16 model's float layers on an AVX512-BF16 CPU at decode and prompt row counts:
kvserve::bf16_linear over pair panels (engine/kernels/cpu/bf16_pairs.cpp) against
oneDNN's bf16 GEMM over the weight it prepacked for that row count (what the frozen
graphs ran: mkldnn._linear_pointwise) and over the plain weight (F.linear, eager).

Several copies of each weight are taken in turn (--copies), so that a weight comes
from memory as it does in a model's step and not from the last call's cache. Every
product is checked against float64 first, so a fast wrong answer cannot pass. Ways
timed round-robin, best of --rounds.

usage: python bench/bf16_pairs.py [--rows 1,2,4,8,16,32,64,128,512]
       [--shapes 16384x2048,2048x8192] [--rounds 5] [--json OUT]
(default shapes: a 1B model's gate/up and down; the default model's are 3072x576 and
576x1536)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.kernels.cpu.bf16_pairs import (amx_here, bf16_linear,  # noqa: E402
                                                   bf16_pairs_here, pack_bf16_pairs)
from kvserve.engine.platform.device import cpu_flags  # noqa: E402
from kvserve.engine.weights.cpu_packing import load_once  # noqa: E402


def check(name: str, got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    want = x.double() @ weight.double().t()
    err = ((got.double() - want).norm() / want.norm()).item()
    if err > 1e-2:  # bf16 outputs: a few parts in a thousand
        raise SystemExit(f"{name}: relative error {err:.4f} against float64")


def one_shape(n: int, k: int, rows_list: list[int], copies: int, rounds: int) -> list[dict]:
    weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
    panels = [pack_bf16_pairs(w) for w in weights]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, k).to(torch.bfloat16)
        prepacked = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        ways = {
            "oneDNN prepacked": lambda i: torch.ops.mkldnn._linear_pointwise(
                x, prepacked[i], None, "none", [], ""),
            "oneDNN plain": lambda i: torch.nn.functional.linear(x, weights[i]),
            "kvserve pairs": lambda i: bf16_linear(x, panels[i], n, None)}
        if amx_here():  # the default kernel is AMX's: AVX512-BF16's beside it
            ways["kvserve pairs avx512"] = lambda i: torch.ops.kvserve.bf16_linear_on(
                x, panels[i], n, None, "avx512")
        for name, f in ways.items():
            check(name, f(0), x, weights[0])
        best = dict.fromkeys(ways, float("inf"))
        for r in range(rounds):
            for name, f in ways.items():
                f((r + 1) % copies)  # warm the code, not the weight
                t = time.perf_counter()
                for i in range(copies):
                    f(i)
                best[name] = min(best[name], (time.perf_counter() - t) / copies)
        pairs = best["kvserve pairs"]
        row = {"shape": [n, k], "rows": rows,
               **{f"{name} ms": round(s * 1e3, 3) for name, s in best.items()},
               "pairs / prepacked": round(pairs / best["oneDNN prepacked"], 3),
               "pairs GB/s": round(n * k * 2 / pairs / 1e9, 1),
               "pairs GFLOP/s": round(2 * rows * n * k / pairs / 1e9, 1)}
        print("  ".join(f"{key} {value}" for key, value in row.items()), flush=True)
        results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,512")
    ap.add_argument("--shapes", default="16384x2048,2048x8192", help="NxK, comma-separated")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not bf16_pairs_here():
        raise SystemExit("this CPU has no AVX512-BF16: bf16_linear does not run here")
    load_once()
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        results += one_shape(n, k, rows, args.copies, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps({
            **provenance("cpu", " ".join(sys.argv)), "cpu_flags": simd_flags(cpu_flags()),
            "threads": torch.get_num_threads(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
