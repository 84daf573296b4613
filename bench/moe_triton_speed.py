"""The routed experts' Triton grouped GEMMs on the GPU (issue 52): one layer of a
Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, top-8) with its experts in
bf16, int8 (a scale a row: --quantization int8) and int4 (codes two to a byte, a
scale and a minimum per 32 inputs: --quantization int4, a GGUF's 4-bit kept experts),
at decode and prompt sizes: ms a call, and the bytes of the experts the call touches
per second against the device's copy bandwidth measured in the same run.

    python bench/moe_triton_speed.py [--tokens 1,16,64,512] --json out.json
    python bench/moe_triton_speed.py --small --json out.json   # CPU: the interpreter

Written after each kind, so a run cut short keeps what it measured
(bench/gpu_session.py's moe_kernels stage)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("bf16", "int8", "int4")


def experts_of(kind: str, hidden: int, inter: int, num: int, device):
    """A FusedExperts layer of random weights, quantized as `kind` says, on device."""
    import torch

    from kvserve.engine.models.moe import FusedExperts

    layer = FusedExperts(num, 0, hidden, inter)
    with torch.no_grad():
        for w in (layer.w13, layer.w2):
            w.normal_(0.0, 0.02)
    if kind == "int8":
        layer.quantize_int8()
    elif kind == "int4":
        layer.quantize_int4(32)
    layer = layer.to(device)
    if kind == "bf16":
        layer = layer.to(torch.bfloat16)
    return layer


def layer_bytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))


def timed(fn, repeats: int, sync) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def copy_gbps(device, mib: int, sync) -> float:
    import torch

    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), 5, sync)
    return 2 * src.numel() / seconds / 1e9  # read and written


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The flags every GPU kernel benchmark of the session takes."""
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--small", action="store_true",
                    help="tiny shapes and one repeat (a CPU dry run through the interpreter)")
    ap.add_argument("--json", type=Path, required=True)


def on_gpu() -> bool:
    """Whether a GPU runs the kernels; else Triton's CPU interpreter does, switched on
    here, before any kernel module is imported."""
    import torch

    if torch.cuda.is_available():
        return True
    os.environ["TRITON_INTERPRET"] = "1"
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="1,16,64,512")
    add_run_args(ap)
    args = ap.parse_args()
    import torch

    cuda = on_gpu()
    from kvserve.engine.kernels.moe.triton_experts import triton_fused_experts

    device = torch.device("cuda" if cuda else "cpu")
    if args.small:
        args.hidden, args.inter, args.experts, args.top_k = 64, 64, 8, 2
        args.tokens, args.repeats = "1,5", 1
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = {"model": "experts of a Qwen3-30B-A3B layer" if not args.small else "tiny experts",
              "dtype": "bf16 activations",
              "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
              "shape": {k: getattr(args, k) for k in ("hidden", "inter", "experts", "top_k")},
              "copy_gbps": round(copy_gbps(device, 8 if args.small else 1024, sync), 1),
              "kinds": {}}
    generator = torch.Generator().manual_seed(0)
    for kind in KINDS:
        layer = experts_of(kind, args.hidden, args.inter, args.experts, device)
        per_expert = layer_bytes(layer) / args.experts
        rows = {}
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden, generator=generator).to(device, torch.bfloat16)
            ids = torch.stack([torch.randperm(args.experts, generator=generator)[:args.top_k]
                               for _ in range(tokens)]).to(device)
            weights = torch.rand(tokens, args.top_k, generator=generator).to(device)

            def call(x=x, ids=ids, weights=weights, layer=layer):
                if cuda:
                    return layer(x, ids, weights)
                # the CPU op would take its own path: the Triton kernels directly
                return triton_fused_experts(
                    x, ids, weights, layer.w13, layer.w2, 0,
                    w13_quant=(layer.w13_scale, layer.w13_min),
                    w2_quant=(layer.w2_scale, layer.w2_min))
            seconds = timed(call, args.repeats, sync)
            touched = ids.unique().numel() * per_expert
            rows[tokens] = {"ms": round(seconds * 1000, 3),
                            "experts_touched": int(ids.unique().numel()),
                            "gbps": round(touched / seconds / 1e9, 1)}
        result["kinds"][kind] = {"bytes_per_expert": int(per_expert), "tokens": rows}
        for tokens, row in rows.items():  # top-level figures: the session's summary
            result[f"{kind}_{tokens}tok_gbps"] = row["gbps"]
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(kind, rows, flush=True)


if __name__ == "__main__":
    main()
