"""`kvserve estimate`: what one GPU can do for a model, from the roofline."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.benchmarks.client.estimate import efficiency, estimate
from kvserve.benchmarks.client.gpus import GPUS, get_gpu
from kvserve.benchmarks.client.model_shape import DTYPE_BYTES, KV_DTYPE_BYTES, load_shape
from kvserve.benchmarks.client.roofline import Setup
from kvserve.modelstore.weight_bytes import QUANTIZATIONS


def add_estimate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="config.json, a model directory, or a preset name (llama-3.1-8b)")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="the decoder projections' weights, as kvserve serve's "
                   "--quantization (int4: a float16 scale and minimum per group)")
    p.add_argument("--quantization-group-size", type=int, default=32, choices=[32, 64, 128])
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default=None,
                   choices=sorted(KV_DTYPE_BYTES),
                   help="as kvserve serve's --kv-cache-dtype (default: --dtype)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--price-per-hour", type=float, default=None,
                   help="$ per GPU-hour (default: the GPU table's)")
    p.add_argument("--calibrate", default=None,
                   help="a result JSON with measured `mbu` (and `mfu`) to scale the peaks")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def setup_from_args(args) -> Setup:
    cal = json.loads(Path(args.calibrate).read_text()) if args.calibrate else {}
    dtype = DTYPE_BYTES[args.dtype]
    return Setup(load_shape(args.model), get_gpu(args.gpu), dtype,
                 KV_DTYPE_BYTES[args.kv_dtype] if args.kv_dtype else dtype,
                 args.gpu_memory_utilization, efficiency(cal, "mbu"), efficiency(cal, "mfu"),
                 args.quantization, args.quantization_group_size)


ROWS = [("GPU", "gpu", "{}"), ("parameters (billions)", "params", "{:.2f}"),
        ("weights (GB)", "weight_gb", "{:.2f}"),
        ("read per decode step, batch 1 (GB)", "decode_read_gb_at_batch_1", "{:.2f}"),
        ("KV per token (bytes)", "kv_bytes_per_token", "{:,.0f}"),
        ("KV budget (GB)", "kv_budget_gb", "{:.2f}"),
        ("KV capacity (tokens)", "kv_capacity_tokens", "{:,}"),
        ("max sequences (prompt+output)", "max_sequences", "{:,}"),
        ("efficiency applied (MBU / MFU)", None, None),
        ("TTFT, one prompt (ms)", "ttft_ms", "{:.1f}"),
        ("prefill (tok/s)", "prefill_tok_s", "{:,.0f}"),
        ("ITL at batch (ms)", "itl_ms", "{:.2f}"),
        ("decode per sequence (tok/s)", "decode_tok_s_per_seq", "{:,.1f}"),
        ("decode aggregate at batch (tok/s)", "decode_tok_s", "{:,.0f}"),
        ("end-to-end one request (s)", "e2el_s", "{:.2f}"),
        ("output tokens per $", "tokens_per_dollar", "{:,.0f}"),
        ("$ per 1M output tokens", "dollars_per_m_tokens", "{:.3f}"),
        ("decode at KV capacity (tok/s)", "decode_tok_s_at_capacity", "{:,.0f}"),
        ("$ per 1M output tokens at capacity", "dollars_per_m_tokens_at_capacity", "{:.3f}")]


def format_estimate(e: dict) -> str:
    lines = [f"{e['prompt_len']} prompt + {e['output_len']} output tokens, batch "
             f"{e['batch']}, ${e['price_per_hour']:.2f}/h"]
    for label, key, fmt in ROWS:
        if key is None:
            value = f"{e['mbu']:.2f} / {e['mfu']:.2f}"
        elif key not in e:
            continue
        else:
            value = fmt.format(e[key] / 1e9 if key == "params" else e[key])
        lines.append(f"{label:<38} {value}")
    lines.append(f"bound by: prefill {e['prefill_bound']}, decode {e['decode_bound']}")
    if e["batch"] > e["max_sequences"]:
        lines.append(f"warning: batch {e['batch']} needs more KV than fits "
                     f"({e['max_sequences']} sequences)")
    return "\n".join(lines)


def estimate_main(args) -> int:
    try:
        s = setup_from_args(args)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise SystemExit(f"kvserve estimate: {exc}") from None
    price = args.price_per_hour if args.price_per_hour is not None else s.gpu.price_per_hour
    e = estimate(s, args.batch, args.prompt_len, args.output_len, price)
    print(json.dumps(e, indent=2) if args.json else format_estimate(e))
    return 0
