"""Where a mixture-of-experts layer's time goes on this CPU (issue 52): routing (the
router's GEMM, softmax, top-k), the pairs' sort and gather, the experts' GEMMs and
the weighted combine, for one layer of the race's shape (bench/moe_checkpoint.py:
64 experts of 384, top-8, hidden 1024, bf16) at 1 to 512 tokens; the batch-1
decode graph's traced form (one_token_experts) beside the op; and the op's two ways
of running the experts' products, each forced: kvserve's kernel
(kvserve::expert_linear, which the op takes up to EXPERT_LINEAR_MAX_ROWS rows per
active expert, DOTS_MAX_ROWS where it takes dot products: bf16 rows and experts
with AVX-512 BF16, int8 experts meeting x quantized to int8) and torch's grouped
GEMM (bf16) or per-expert loop (int8), for bf16 and --quantization int8 experts,
the latter with and without int8_inputs (as the engine runs them: with). One
layer's tensors are called again and again, so at 1 token its 8 experts stay in
L3: bench/moe_from_memory.py reads them from memory, as a decode step does.

    python bench/moe_split.py [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.engine.kernels.moe import fused_experts as op  # noqa: E402
from kvserve.engine.kernels.moe.fused_experts import (fused_experts, gated,  # noqa: E402
                                                      one_token_experts)
from kvserve.engine.models.quantized.int8 import quantize_int8  # noqa: E402
from kvserve.engine.weights.cpu_packing import load_once  # noqa: E402


def timed(fn, repeats: int = 30) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def split(tokens: int, experts: int, top_k: int, hidden: int, inter: int,
          dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    router = (torch.randn(experts, hidden, generator=g) * 0.02).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.02).to(dtype)

    def route():
        w, ids = torch.softmax(F.linear(x, router), -1, dtype=torch.float32).topk(top_k)
        return ids, (w / w.sum(-1, keepdim=True)).to(dtype)

    ids, weights = route()
    sorted_ids, order = ids.reshape(-1).sort(stable=True)
    counts = torch.bincount(sorted_ids, minlength=experts)
    tokens_of = order // top_k
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[tokens_of]

    def gemms():
        h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        return torch._grouped_mm(gated(h, "silu", 0.0, 0.0), w2.transpose(1, 2), offs=offs)

    y = gemms()
    out = {
        "routing_ms": timed(route),
        "sort_gather_ms": timed(lambda: x[ids.reshape(-1).sort(stable=True).indices
                                         // top_k]),
        "expert_gemms_ms": timed(gemms),
        "combine_ms": timed(lambda: torch.zeros_like(x).index_add_(
            0, tokens_of, (y * weights.reshape(-1)[order, None]).to(dtype))),
        "op_total_ms": timed(lambda: fused_experts(x, ids, weights, w13, w2, 0)),
        "active_experts": int((counts > 0).sum()),
    }
    if tokens == 1:
        compiled = torch.compile(one_token_experts, fullgraph=True, dynamic=False)
        out["traced_batch1_ms"] = timed(lambda: compiled(x, ids, weights, w13, w2, 0))
    read = out["active_experts"] * 3 * hidden * inter * dtype.itemsize
    out["op_weight_gb_s"] = read / out["op_total_ms"] / 1e6
    limits = op.EXPERT_LINEAR_MAX_ROWS, op.DOTS_MAX_ROWS
    (q13, s13), (q2, s2) = _int8(w13), _int8(w2)
    int8 = dict(w13_scale=s13, w2_scale=s2)
    kinds = {"bf16": (w13, w2, {}), "int8": (q13, q2, int8),
             "int8_inputs": (q13, q2, dict(int8, int8_inputs=True))}
    for kind, (weights13, weights2, quant) in kinds.items():
        for way, rows in (("kernel", 1 << 30), ("torch", 0)):
            op.EXPERT_LINEAR_MAX_ROWS = op.DOTS_MAX_ROWS = rows
            ms = timed(lambda: fused_experts(x, ids, weights, weights13, weights2, 0, **quant))
            out[f"{kind}_{way}_ms"] = ms
            out[f"{kind}_{way}_gb_s"] = read / (1 if kind == "bf16" else 2) / ms / 1e6
    op.EXPERT_LINEAR_MAX_ROWS, op.DOTS_MAX_ROWS = limits
    return out


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """--quantization int8's experts: int8 rows with a scale each."""
    q, scales = quantize_int8(w.reshape(-1, w.shape[-1]), w.dtype)
    return q.view(w.shape), scales.view(w.shape[:2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    load_once()
    from kvserve.benchmarks.provenance import simd_flags
    from kvserve.engine.platform.device import cpu_flags

    result = {str(t): split(t, 64, 8, 1024, 384, torch.bfloat16)
              for t in (1, 16, 32, 128, 512)}
    for t, row in result.items():
        print(t, {k: round(v, 3) for k, v in row.items()})
    result["cpu_flags"] = simd_flags(cpu_flags())
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
