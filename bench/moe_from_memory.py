"""A mixture-of-experts layer's experts read from memory, as a decode step reads them
(issue 52): 24 layers of the race's shape (bench/moe_checkpoint.py: 64 experts of
1024 x 384, top-8), each called in turn, so no layer's experts are still in cache
when it comes again (bench/moe_split.py repeats one layer, whose 8 experts a token
stay in L3). For 1 token: kvserve::moe_experts (the op) against the batch-1 graph's
traced form (one_token_experts, compiled); for 16 tokens: the op. bf16 and
--quantization int8 experts (int8 inputs), each with torch's allocations in 4 KiB
pages and in transparent huge pages (THP_MEM_ALLOC_ENABLE, which `kvserve` sets:
server/entrypoints/cli.py), each in a process of its own.

    python bench/moe_from_memory.py [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LAYERS, EXPERTS, HIDDEN, INTER, TOP_K = 24, 64, 1024, 384, 8


def measure(kind: str) -> dict:
    """ms a layer and GB/s of expert weights, in this process."""
    import torch

    from kvserve.engine.kernels.moe.fused_experts import one_token_experts
    from kvserve.engine.models.quantized.int8 import quantize_int8
    from kvserve.engine.weights.cpu_packing import load_once

    load_once()
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.02).bfloat16()
        w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.02).bfloat16()
        if kind == "int8":
            (q13, s13), (q2, s2) = (quantize_int8(w.reshape(-1, w.shape[-1]), w.dtype)
                                    for w in (w13, w2))
            w13, w2 = q13.view(w13.shape), q2.view(w2.shape)
            layers.append((w13, w2, s13.view(w13.shape[:2]), s2.view(w2.shape[:2])))
        else:
            layers.append((w13, w2, None, None))
    int8_inputs = kind == "int8"

    def op(x, ids, w, w13, w2, s13, s2):
        return torch.ops.kvserve.moe_experts(x, ids, w, w13, w2, 0, s13, s2, None, None,
                                             int8_inputs, 32)

    def traced_fn(x, ids, w, w13, w2, s13, s2):
        return one_token_experts(x, ids, w, w13, w2, 0, None, None, "silu", 0.0, 0.0, s13,
                                 s2)

    ways = {"op": op, "traced": torch.compile(traced_fn, dynamic=False)}
    out = {}
    for tokens in (1, 16):
        x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
        ids = [torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K]
                            for _ in range(tokens)]) for _ in range(LAYERS)]
        weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), -1)
        active = sum(len(set(i.view(-1).tolist())) for i in ids) / LAYERS
        read = active * 3 * HIDDEN * INTER * (1 if kind == "int8" else 2)
        for way, fn in ways.items():
            if tokens > 1 and way == "traced":
                continue
            for layer in range(LAYERS):  # (compiles the traced form)
                fn(x, ids[layer], weights, *layers[layer])
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for r in range(10):
                    for layer in range(LAYERS):
                        fn(x, ids[(layer + r) % LAYERS], weights, *layers[layer])
                best = min(best, (time.perf_counter() - t0) / 10 / LAYERS * 1e3)
            out[f"{way}_{tokens}tok_ms"] = round(best, 3)
            out[f"{way}_{tokens}tok_gb_s"] = round(read / best / 1e6, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--measure", choices=("bf16", "int8"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:  # a child: one kind, this process's pages
        print(json.dumps(measure(a.measure)))
        return
    from kvserve.benchmarks.provenance import simd_flags
    from kvserve.engine.platform.device import cpu_flags

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    result = {"cpu_flags": simd_flags(cpu_flags()),
              "thp_mode": thp.read_text().strip() if thp.exists() else None}
    for kind in ("bf16", "int8"):
        for pages, env in (("4k", "0"), ("thp", "1")):
            proc = subprocess.run(
                [sys.executable, __file__, "--measure", kind], capture_output=True,
                text=True, check=True, cwd=ROOT,
                env={**os.environ, "THP_MEM_ALLOC_ENABLE": env})
            result[f"{kind}_{pages}"] = json.loads(proc.stdout.splitlines()[-1])
            print(kind, pages, result[f"{kind}_{pages}"], flush=True)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
