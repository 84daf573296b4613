"""One quantized layer of a bf16 model at decode and prompt row counts: kvserve's op
over int8 (per-column scales, --quantization int8; GGUF's Q8_0, a scale per 32) and
int4 (group 32, --quantization int4; and group 128) panels, bf16 rows as a bf16
model's step gives them, against oneDNN's bf16 GEMM over the bf16 weights (F.linear,
what the float layers run on AVX-512 CPUs).

Where the op takes integer products (packing.takes_dots: AVX512-VNNI at any row
count) each product is checked against packing.reference_product, elsewhere against
the float product, so a fast wrong answer cannot pass. One weight, read from cache
or memory as its size makes it (the default shape, a 1B model's gate/up, is 64 MiB in
bf16); ways timed round-robin, best of --rounds.

usage: python bench/quantized_rows.py [--rows 1,16,64,128,256,512] [--shape 16384,2048]
       [--rounds 5] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.engine.kernels.cpu import packing  # noqa: E402
from kvserve.engine.models.quantized.int4 import Int4Linear  # noqa: E402
from kvserve.engine.models.quantized.int8 import Int8Linear  # noqa: E402
from kvserve.engine.platform.device import cpu_flags  # noqa: E402
from kvserve.engine.weights.cpu_packing import load_once  # noqa: E402


def checked(name: str, got: torch.Tensor, x: torch.Tensor, packed: packing.Packed | None,
            weight: torch.Tensor) -> None:
    n = weight.shape[0]
    if packed is not None and packing.takes_dots(packed, len(x), x.shape[1]):
        want = packing.reference_product(x.float(), packed, n, True)
    else:
        w = weight if packed is None else packing.unpack_weight(packed, n)
        want = x.double() @ w.double().t()
    err = ((got.double() - want).norm() / want.norm()).item()
    if err > 1e-2:  # bf16 outputs: a few parts in a thousand
        raise SystemExit(f"{name}: relative error {err:.4f} against its reference")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64,128,256,512")
    ap.add_argument("--shape", default="16384,2048", help="N,K of the weight")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    load_once()
    n, k = map(int, args.shape.split(","))
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    int8 = packing.PackedWeight(Int8Linear.of(linear).quantized_panels(), True)
    q8_0 = packing.PackedWeight(packing.pack_int8(
        *packing.round_int8_groups(linear.weight.float())), True)
    int4 = packing.PackedWeight(Int4Linear.of(linear, 32).quantized_panels(), True)
    int4_g128 = packing.PackedWeight(Int4Linear.of(linear, 128).quantized_panels(), True)
    ways = {"oneDNN bf16": (None, lambda x: nn.functional.linear(x, linear.weight))}
    for name, packed in (("kvserve int8", int8), ("kvserve Q8_0", q8_0),
                         ("kvserve int4", int4), ("kvserve int4 g128", int4_g128)):
        ways[name] = (packed.contents(), lambda x, w=packed: w.product(x, n, None))
    flags = sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                                  "avx512vbmi", "amx_tile"})
    results = []
    print(f"weight {n} x {k}, bf16 rows; flags {' '.join(flags)}; ms, best of {args.rounds}")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, k).to(torch.bfloat16)
        best = dict.fromkeys(ways, float("inf"))
        for name, (packed, f) in ways.items():
            checked(name, f(x), x, packed, linear.weight)
        for _ in range(args.rounds):
            for name, (_, f) in ways.items():
                t = time.perf_counter()
                f(x)
                best[name] = min(best[name], time.perf_counter() - t)
        row = {"rows": rows, **{name: round(s * 1e3, 3) for name, s in best.items()},
               "integer products": {name: packing.takes_dots(p, rows, k)
                                    for name, (p, _) in ways.items() if p is not None}}
        results.append(row)
        print(f"rows {rows:5d} | " + " | ".join(
            f"{name} {s * 1e3:8.2f} ({rows * n * k / s / 1e9:4.0f} GMAC/s)"
            for name, s in best.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": [n, k], "flags": flags,
                                               "torch": torch.__version__,
                                               "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
