"""kvserve::bf16_linear of this tree against the same kernel at another git revision,
in one process: the revision's engine/kernels/cpu/bf16_pairs.cpp is built on its own
(namespace kvserve_then, so both register), and a model's layers are run through
each in turn, passes alternating, so that the host's drift (a shared machine's
bandwidth moves by half within minutes) weighs on both alike. Each pass runs every
layer of a stack of the given shapes once (--layers copies of each shape, so the
weights come from memory as in a decode step); reported: the median and quartiles
of the passes, each way, and the GB/s of weights read. Every product is checked to
be the same bits both ways first, or where the kernels round differently by design
(AMX's tiles against vdpbf16ps), each the product to bf16's rounding.

usage: python bench/bf16_pairs_ab.py --against 4825504 [--rows 1] [--shapes 1b]
       [--passes 200] [--json OUT]
(shapes: 1b = a Llama-3.2-1B layer's qkv, o, gate/up and down, 16 layers; default =
the default model's, 30 layers; or NxK,NxK,... with --layers)
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.bf16_pairs import check  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.kernels.cpu import build  # noqa: E402
from kvserve.engine.kernels.cpu.bf16_pairs import (bf16_pairs_here, pack_bf16_pairs,  # noqa: E402
                                                   pairs_values)
from kvserve.engine.platform.device import cpu_flags  # noqa: E402
from kvserve.engine.weights.cpu_packing import load_once  # noqa: E402

SHAPES = {"1b": ("3072x2048,2048x2048,16384x2048,2048x8192", 16),
          "default": ("960x576,576x576,3072x576,576x1536", 30)}
SOURCE = "engine/kernels/cpu/bf16_pairs.cpp"


def build_then(revision: str, out: Path) -> None:
    """The revision's kernel as a library of its own, its op kvserve_then::bf16_linear."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout

    text = show(SOURCE)
    for header in re.findall(r'^#include "([^"]+)"', text, flags=re.M):  # the revision's own
        (out.parent / header).write_text(show(f"{Path(SOURCE).parent}/{header}"))
    text = (text.replace("TORCH_LIBRARY_FRAGMENT(kvserve,", "TORCH_LIBRARY_FRAGMENT(kvserve_then,")
            .replace("TORCH_LIBRARY_IMPL(kvserve,", "TORCH_LIBRARY_IMPL(kvserve_then,")
            .replace("aoti_torch_cpu_bf16_linear", "aoti_torch_cpu_bf16_linear_then"))
    source = out.with_suffix(".cpp")
    source.write_text(text)
    compiler = build.c_compiler()
    obj = out.with_suffix(".o")
    for command in (build._compile_command(compiler, source, obj),
                    build._link_command(compiler, [obj], out)):
        subprocess.run(command, check=True, capture_output=True)
    torch.ops.load_library(str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="a git revision of this repository")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--shapes", default="1b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--passes", type=int, default=200, help="passes each way")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not bf16_pairs_here():
        raise SystemExit("this CPU has no AVX512-BF16: bf16_linear does not run here")
    load_once()
    shapes, layers = SHAPES.get(args.shapes, (args.shapes, args.layers or 1))
    layers = args.layers or layers
    with tempfile.TemporaryDirectory() as tmp:
        build_then(args.against, Path(tmp) / "then.so")
    torch.manual_seed(0)
    stack = []
    for _ in range(layers):
        for shape in shapes.split(","):
            n, k = map(int, shape.split("x"))
            stack.append((pack_bf16_pairs(torch.randn(n, k).to(torch.bfloat16)), n,
                          torch.randn(args.rows, k).to(torch.bfloat16)))
    nbytes = sum(p.numel() * 2 for p, _, _ in stack)
    ways = {"now": torch.ops.kvserve.bf16_linear, "then": torch.ops.kvserve_then.bf16_linear}
    same_bits = True
    for panels, n, x in stack[:8]:
        now, then = ways["now"](x, panels, n, None), ways["then"](x, panels, n, None)
        if torch.equal(now, then):
            continue
        # Kernels that sum in another order (AMX's tiles against vdpbf16ps) differ in
        # the last bits: both must then be the product to bf16's rounding.
        same_bits = False
        weight = pairs_values(panels, n)
        for name, got in (("now", now), ("then", then)):
            check(f"{name}, a {n}-output layer", got, x, weight)
    print("same bits both ways" if same_bits else
          "the kernels round differently (AMX here?): both checked against float64")
    times = {name: [] for name in ways}
    for i in range(2 * args.passes + 2):
        name = ("now", "then")[i % 2]
        op = ways[name]
        t = time.perf_counter()
        for panels, n, x in stack:
            op(x, panels, n, None)
        if i >= 2:  # the first pass each way warms the code
            times[name].append(time.perf_counter() - t)
    result = {}
    for name, ts in times.items():
        q1, median, q3 = statistics.quantiles(ts, n=4)
        result[name] = {"median_ms": round(median * 1e3, 3), "q1_ms": round(q1 * 1e3, 3),
                        "q3_ms": round(q3 * 1e3, 3), "GB/s": round(nbytes / median / 1e9, 1)}
        print(name, result[name], flush=True)
    result["now / then"] = round(result["now"]["median_ms"] / result["then"]["median_ms"], 3)
    print("now / then", result["now / then"])
    if args.json:
        Path(args.json).write_text(json.dumps({
            **provenance("cpu", " ".join(sys.argv)), "cpu_flags": simd_flags(cpu_flags()),
            "threads": torch.get_num_threads(), "against": args.against, "rows": args.rows,
            "shapes": shapes, "layers": layers, "weight_bytes": nbytes,
            "same_bits": same_bits, **result},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
