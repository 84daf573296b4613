"""kvserve's packed CPU GEMM (engine/kernels/cpu) against torch's, per decode step.

For every row count asked (decode batch sizes, prompt chunks), one "step" multiplies
that many float32 rows by every linear weight of a model shape once, each layer's
weights distinct so they come from memory as in a real step (--layers of them, the
time scaled to the model's layer count). The ways:
- oneDNN: torch's packed float32 linear, what Inductor's compiled graphs call;
- torch linear: F.linear (MKL), the eager path;
- kvserve fp32 / kvserve bf16: kvserve::packed_linear over float32 panels, and over
  bf16 panels (the weights rounded to bf16 first, as a bf16 checkpoint's are);
- kvserve int8 / kvserve int4: over int8 panels with a float16 scale per 32 inputs
  (the weights rounded to GGUF's Q8_0 grid first) and int4 ones with a float16 scale
  and minimum per 32 (Q4_1's grid), the way a GGUF's blocks are served (int4 up to 12
  rows by integer products over inputs quantized to int8).
Every way's product is checked against a float64 one inside the benchmark, so a fast
wrong answer cannot pass. The ways are timed round-robin, --rounds times, and each
keeps its best round: the machines are shared and noisy.

usage: python bench/cpu_gemm.py [--rows 1,4,16,32,64,256] [--rounds 7] [--json OUT]
       [--shape hidden,intermediate,q_heads*head_dim,kv_heads*head_dim,vocab,layers]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvserve.benchmarks.in_process.utilisation import copy_bandwidth  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.kernels.cpu.packing import (pack_weight, packed_linear,  # noqa: E402
                                                reference_product)
from kvserve.engine.platform.device import cpu_flags  # noqa: E402
from kvserve.engine.weights.cpu_packing import load_once  # noqa: E402

# SmolLM2-135M: hidden, intermediate, q width, kv width, vocabulary, layers
DEFAULT_SHAPE = (576, 1536, 576, 192, 49152, 30)
WAYS = ("oneDNN", "torch linear", "kvserve fp32", "kvserve bf16", "kvserve int8",
        "kvserve int4")
BYTES_PER_WEIGHT = {"kvserve bf16": 2, "kvserve int8": 34 / 32, "kvserve int4": 20 / 32}


def projections(shape) -> dict[str, tuple[int, int, int]]:
    """name -> (out, in, count a step): the fused q/k/v and gate/up as served."""
    hidden, inter, q, kv, vocab, layers = shape
    return {"qkv": (q + 2 * kv, hidden, layers), "o": (hidden, q, layers),
            "gate_up": (2 * inter, hidden, layers), "down": (hidden, inter, layers),
            "lm_head": (vocab, hidden, 1)}


def _onednn(rows: int):
    def prepare(w):
        return torch.ops.mkldnn._reorder_linear_weight(w, rows)

    def run(x, w, n):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
    return prepare, run


# Served as a GGUF's quantized layers are: their inputs may be quantized to int8 too
# (int4 panels up to 12 rows), which the check's reference then does as well.
INT8_INPUT_WAYS = ("kvserve int8", "kvserve int4")


def _way(name: str, rows: int):
    if name == "oneDNN":
        return _onednn(rows)
    if name == "torch linear":
        return (lambda w: w), (lambda x, w, n: F.linear(x, w))
    int8_inputs = name in INT8_INPUT_WAYS
    return (lambda w: pack_weight(values(name, w))), \
        (lambda x, w, n: packed_linear(x, w, n, None, int8_inputs))


def values(way: str, w: torch.Tensor) -> torch.Tensor:
    """The float weight a way computes with: w, or w on its format's grid."""
    if way.endswith("bf16"):
        return w.bfloat16().float()
    if way.endswith("int8"):
        return _on_grid(w, levels=127, symmetric=True)
    if way.endswith("int4"):
        return _on_grid(w, levels=15, symmetric=False)
    return w


def _on_grid(w: torch.Tensor, levels: int, symmetric: bool) -> torch.Tensor:
    """Each group of 32 inputs rounded as GGUF's Q8_0 (symmetric, 127 steps of a
    float16 scale) or Q4_1 (15 steps of a float16 scale up from a float16 minimum)
    rounds it, the group's extremes on the ends of the grid as theirs are."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    if symmetric:
        low = torch.zeros(n, k // 32, 1)
        scale = (g.abs().amax(dim=2, keepdim=True) / levels).half().float()
        q = torch.round(g / scale).clamp(-levels, levels)
        top = g.abs().argmax(dim=2, keepdim=True)
        q.scatter_(2, top, torch.sign(g.gather(2, top)) * levels)
    else:
        low = g.amin(dim=2, keepdim=True).half().float()
        scale = ((g.amax(dim=2, keepdim=True) - low) / levels).half().float()
        q = torch.round((g - low) / scale).clamp(0, levels)
        q.scatter_(2, g.argmin(dim=2, keepdim=True), 0)
        q.scatter_(2, g.argmax(dim=2, keepdim=True), levels)
    return (q * scale + low).reshape(n, k)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,32,64,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30,
                    help="distinct weights per projection timed (scaled to the model's)")
    ap.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)))
    ap.add_argument("--copy-mib", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    load_once()
    shape = tuple(int(v) for v in args.shape.split(","))
    rows_list = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    weights = {name: [torch.randn(n, k, generator=gen) * k ** -0.5
                      for _ in range(min(count, args.layers))]
               for name, (n, k, count) in projections(shape).items()}
    copy_gbps = copy_bandwidth(torch.device("cpu"), args.copy_mib, 3)["gbps"]
    cases = []
    with torch.inference_mode():
        for rows in rows_list:
            xs = {name: torch.randn(rows, ws[0].shape[1], generator=gen)
                  for name, ws in weights.items()}
            prepared = {}
            for way in WAYS:
                prepare, run = _way(way, rows)
                prepared[way] = ({name: [prepare(w) for w in ws]
                                  for name, ws in weights.items()}, run)
                _check(way, run, prepared[way][0], xs, weights)
            best = {way: float("inf") for way in WAYS}
            for _ in range(args.rounds):
                for way in WAYS:
                    best[way] = min(best[way], _step_ms(*prepared[way], xs, shape))
            flops = 2 * rows * sum(n * k * c for n, k, c in projections(shape).values())
            params = sum(n * k * c for n, k, c in projections(shape).values())
            for way in WAYS:
                nbytes = params * BYTES_PER_WEIGHT.get(way, 4)
                cases.append({"rows": rows, "way": way, "step_ms": _figures(best[way]),
                              "gflops": _figures(flops / best[way] / 1e6),
                              "weight_gbps": _figures(nbytes / best[way] / 1e6)})
    all_flags = cpu_flags()
    flags = simd_flags(all_flags)
    result = {**provenance(), "cpu_flags": flags, "torch": torch.__version__,
              "capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "copy_gbps": round(copy_gbps, 2),
              "shape": shape, "layers_timed": args.layers, "rounds": args.rounds,
              "cases": cases}
    print(f"{result['device']}, {result['capability']}, {result['threads']} threads, flags "
          f"{' '.join(flags)}; copy {copy_gbps:.1f} GB/s (read + written); shape {shape}")
    print("| rows | " + " | ".join(f"{w} ms" for w in WAYS) + " |")
    print("|---|" + "---|" * len(WAYS))
    for rows in rows_list:
        ms = {c["way"]: c["step_ms"] for c in cases if c["rows"] == rows}
        print(f"| {rows} | " + " | ".join(f"{ms[w]:.2f}" for w in WAYS) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _figures(value: float) -> float:
    """Four significant figures: a fixed count of decimals rounds a tiny shape's
    slow round (a noisy neighbour, a first oneDNN call) to 0 GFLOP/s."""
    return float(f"{value:.4g}")


def _step_ms(prepared, run, xs, shape) -> float:
    """One step's linear layers: each projection's timed weights, scaled to its count."""
    total = 0.0
    for name, (n, _, count) in projections(shape).items():
        ws = prepared[name]
        t0 = time.perf_counter()
        for w in ws:
            run(xs[name], w, n)
        total += (time.perf_counter() - t0) * count / len(ws)
    return total * 1e3


def _check(way, run, prepared, xs, weights) -> None:
    for name, ws in weights.items():
        w = values(way, ws[0])
        if way in INT8_INPUT_WAYS:
            want = reference_product(xs[name], prepared[name][0], w.shape[0], True)
        else:
            want = F.linear(xs[name].double(), w.double())
        got = run(xs[name], prepared[name][0], w.shape[0]).double()
        scale = want.abs().max().item() or 1.0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * scale,
                                   msg=lambda m: f"{way}, {name}: {m}")


if __name__ == "__main__":
    raise SystemExit(main())
