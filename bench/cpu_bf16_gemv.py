"""Can bf16 weights be read at the memory's speed on a CPU without native bf16?

Issue 18 on an AVX2-only CPU: fp32 batch-1 decode sits at its memory floor (it reads
4 bytes a weight), and the bf16 graph's GEMV template is 1.8x off its own floor
(bench/results/cpu_profile_avx2_2026-11-25.md). This times one large weight (the
default model's LM head shape, 49152 x 576) read once per call, at 1 and 16 rows, in
the ways a forward pass could do it:
- fp32 weights: torch's linear, Inductor's reduction;
- bf16 weights: torch's bf16 linear, Inductor's reduction widening bf16 to fp32 as it
  loads (what llama.cpp's BF16 dot product does), Inductor widening the whole weight
  to fp32 before an fp32 matmul (what batches would pay).

Each way's output is checked against torch's fp32 linear on the bf16-rounded weights
(fp32 arithmetic) or the fp32 ones, so a fast wrong answer cannot pass.

usage: python bench/cpu_bf16_gemv.py [--json OUT] [--repeats 30] [--shape 49152 576]
       [--copy-mib 512]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvserve.benchmarks.in_process.utilisation import copy_bandwidth  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.platform.device import NATIVE_BF16_FLAGS, cpu_flags  # noqa: E402

ROWS_OUT, ROWS_IN = 49152, 576  # SmolLM2-135M's LM head


def _ms(fn, *args, repeats: int) -> float:
    for _ in range(3):
        fn(*args)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - t0) / repeats * 1e3


def _widen_reduce(x, w):  # x fp32 (rows, K), w bf16 (N, K): fp32 arithmetic
    return (x[:, None, :] * w.float()[None]).sum(-1)


def _reduce(x, w):
    return (x[:, None, :] * w[None]).sum(-1)


def _widen_then_mm(x, w):
    return torch.nn.functional.linear(x, w.float())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--shape", type=int, nargs=2, default=[ROWS_OUT, ROWS_IN],
                    metavar=("OUT", "IN"), help="the weight's shape")
    ap.add_argument("--copy-mib", type=int, default=512,
                    help="copy-bandwidth buffer, far past the caches")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    w32 = torch.randn(*args.shape)
    w16 = w32.to(torch.bfloat16)
    linear = torch.nn.functional.linear
    # (weights, how, fn, bf16 input, 1 row only: a reduction per row re-reads the weight)
    ways = [("fp32", "torch linear", linear, False, False),
            ("fp32", "Inductor reduction", torch.compile(_reduce, dynamic=False), False, True),
            ("bf16", "torch bf16 linear", linear, True, False),
            ("bf16", "Inductor reduction, widened as loaded",
             torch.compile(_widen_reduce, dynamic=False), False, True),
            ("bf16", "Inductor: widen all, then fp32 linear",
             torch.compile(_widen_then_mm, dynamic=False), False, False)]
    copy_gbps = copy_bandwidth(torch.device("cpu"), args.copy_mib, args.repeats)["gbps"]
    cases = []
    with torch.inference_mode():
        for rows in (1, 16):
            x = torch.randn(rows, args.shape[1])
            for weights, how, fn, bf16_input, one_row_only in ways:
                if rows > 1 and one_row_only:
                    continue
                w = w16 if weights == "bf16" else w32
                xin = x.bfloat16() if bf16_input else x
                want = linear(xin.float(), w.float())
                got = fn(xin, w).float()
                # tolerance relative to the largest output: torch's bf16 linear rounds
                # its input and output to bf16, the rest only sum in another order
                tol = 2e-2 if bf16_input else 1e-4
                torch.testing.assert_close(got, want, rtol=0,
                                           atol=tol * want.abs().max().item())
                ms = _ms(fn, xin, w, repeats=args.repeats)
                at_half_copy = w.numel() * w.element_size() / (copy_gbps / 2 * 1e6)
                cases.append({"rows": rows, "weights": weights, "how": how,
                              "ms": round(ms, 3), "at_half_copy_ms": round(at_half_copy, 3)})
    all_flags = cpu_flags()
    flags = simd_flags(all_flags)
    result = {**provenance(), "cpu_flags": flags,
              "native_bf16": any(f in all_flags for f in NATIVE_BF16_FLAGS),
              "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "copy_gbps": round(copy_gbps, 2),
              "weight": args.shape, "cases": cases}
    print(f"{result['device']}, {result['capability']}, flags {' '.join(flags)}; "
          f"copy {copy_gbps:.1f} GB/s (read + written); weight {args.shape[0]} x {args.shape[1]}")
    print("| rows | weights | how | ms | weight bytes at half the copy bandwidth, ms |")
    print("|---|---|---|---|---|")
    for c in cases:
        print(f"| {c['rows']} | {c['weights']} | {c['how']} | {c['ms']:.2f} "
              f"| {c['at_half_copy_ms']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
