"""This CPU's memory bandwidth, all cores in one run, and batch-1 decode's share of it.

Batch-1 decode reads every weight and the whole KV cache once per token and does
little arithmetic with them, so its ceiling is the machine's read bandwidth; this
probe measures that ceiling on the machine itself, instead of a datasheet figure.
Over one buffer of --gib GiB (far larger than the last-level cache, so the figures
are DRAM's, not the cache's), with torch on every core (--threads):
  read   buffer.sum(): bytes read / s (a float32 sum stays memory bound: one add per
         4 bytes loaded);
  copy   a = b: STREAM counts 2 x bytes (1 read + 1 write);
  triad  a = b + s * c: STREAM counts 3 x bytes (2 reads + 1 write).
STREAM's convention leaves out the write-allocate read (a plain store first reads
its cache line), so copy and triad are also given with it counted (3 and 4 x bytes).
Each is run once to warm up, then --repeats times; best and median GB/s (1e9 B/s).

With --decode-ms, --model-bytes and --kv-bytes (the KV cache bytes one token reads
at its context: layers * 2 * kv_heads * head_dim * dtype bytes * context, see
kv_cache_bytes) it also prints the decode's achieved GB/s against the read figure
of this same run.

    python bench/bandwidth.py --json bench/results/bandwidth_<machine>_<date>.json
    python bench/bandwidth.py --decode-ms 21.5 --model-bytes 269060096 --kv-bytes 23040000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.compare_cpu import loadavg  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.platform.device import cpu_flags  # noqa: E402

FLOAT32_BYTES = 4


def kv_cache_bytes(num_layers: int, kv_heads: int, head_dim: int, context_len: int,
                   dtype_bytes: int = 2) -> int:
    """Bytes of K and V one decode token reads: every layer's cache up to context_len."""
    return num_layers * 2 * kv_heads * head_dim * dtype_bytes * context_len


def decode_bytes(model_bytes: int, num_layers: int, kv_heads: int, head_dim: int,
                 context_len: int, dtype_bytes: int = 2) -> int:
    """Bytes a dense model's batch-1 decode token reads: every weight once, plus the KV
    cache at context_len (activations are small enough to stay in cache)."""
    return model_bytes + kv_cache_bytes(num_layers, kv_heads, head_dim, context_len,
                                        dtype_bytes)


def decode_efficiency(bytes_per_token: float, seconds_per_token: float,
                      read_gbs: float) -> dict:
    """How close a decode comes to the read bandwidth: its achieved GB/s, that as a
    fraction of read_gbs, and the tokens/s it would reach at the full read rate."""
    achieved_gbs = bytes_per_token / seconds_per_token / 1e9
    return {"bytes_per_token": bytes_per_token, "seconds_per_token": seconds_per_token,
            "achieved_gbs": achieved_gbs, "fraction_of_read": achieved_gbs / read_gbs,
            "tokens_per_s_at_read_bandwidth": read_gbs * 1e9 / bytes_per_token}


def timed_gbs(step: Callable[[], object], bytes_moved: int, repeats: int) -> dict:
    """Best and median GB/s of `step` over `repeats` timings, after one warm-up (which
    faults in any page the step writes and lets the thread pool start)."""
    step()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    return {"bytes": bytes_moved, "best_gbs": bytes_moved / min(seconds) / 1e9,
            "median_gbs": bytes_moved / statistics.median(seconds) / 1e9,
            "seconds": seconds}


def measure(gib: float, repeats: int) -> dict:
    """read, copy and triad over one float32 buffer of `gib` GiB: read sums all of it;
    copy and triad work on its thirds (a, b, c), so every pass touches the same
    working set."""
    n = int(gib * 2**30) // FLOAT32_BYTES // 3 * 3
    # Filled, not just allocated: untouched pages would all map the kernel's one zero
    # page, which the read pass would then read from cache.
    buffer = torch.empty(n).fill_(1.0)
    a, b, c = buffer.view(3, -1).unbind(0)
    array_bytes = a.numel() * FLOAT32_BYTES
    scalar = 3.0
    copy = timed_gbs(lambda: a.copy_(b), 2 * array_bytes, repeats)
    triad = timed_gbs(lambda: torch.add(b, c, alpha=scalar, out=a), 3 * array_bytes,
                      repeats)
    # Write-allocate: a plain store reads its line first, one more array's bytes. An
    # upper figure: a copy done by a memcpy with non-temporal stores (glibc's, for
    # large sizes) skips that read, and STREAM's count is then the true traffic.
    for result, stream_arrays in ((copy, 2), (triad, 3)):
        scale = (stream_arrays + 1) / stream_arrays
        result["best_gbs_with_write_allocate"] = result["best_gbs"] * scale
        result["median_gbs_with_write_allocate"] = result["median_gbs"] * scale
    return {"working_set_bytes": n * FLOAT32_BYTES, "array_bytes": array_bytes,
            "read": timed_gbs(lambda: buffer.sum(), n * FLOAT32_BYTES, repeats),
            "copy": copy, "triad": triad}


def cpu_model() -> str:
    """lscpu's model name, else /proc/cpuinfo's; '' if neither says."""
    for read, prefix in ((_lscpu, "Model name:"), (_cpuinfo, "model name")):
        name = next((line.split(":", 1)[1].strip() for line in read().splitlines()
                     if line.strip().startswith(prefix)), "")
        if name:
            return name
    return ""


def _lscpu() -> str:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def table(result: dict) -> str:
    bw = result["bandwidth"]
    lines = [f"{result['cpu_model'] or result['device']}, {result['threads']} threads, "
             f"working set {bw['working_set_bytes'] / 2**30:.2f} GiB, "
             f"{result['repeats']} repeats, load {result['loadavg']}",
             "| pass | counted | best GB/s | median GB/s |", "|---|---|---|---|",
             f"| read | 1 x bytes | {bw['read']['best_gbs']:.2f} | "
             f"{bw['read']['median_gbs']:.2f} |"]
    for name, arrays in (("copy", 2), ("triad", 3)):
        r = bw[name]
        lines += [f"| {name} | {arrays} x bytes (STREAM) | {r['best_gbs']:.2f} | "
                  f"{r['median_gbs']:.2f} |",
                  f"| {name} | {arrays + 1} x bytes (with write-allocate) | "
                  f"{r['best_gbs_with_write_allocate']:.2f} | "
                  f"{r['median_gbs_with_write_allocate']:.2f} |"]
    if "decode" in result:
        d = result["decode"]
        lines.append(f"decode: {d['bytes_per_token'] / 1e6:.1f} MB/token in "
                     f"{d['seconds_per_token'] * 1e3:.2f} ms = "
                     f"{d['achieved_gbs']:.2f} GB/s, "
                     f"{d['fraction_of_read']:.0%} of the best read; at the read bandwidth "
                     f"{d['tokens_per_s_at_read_bandwidth']:.1f} tokens/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="working set, GiB")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="default: every core")
    ap.add_argument("--json", default=None)
    ap.add_argument("--decode-ms", type=float, default=None, help="a decode's ms/token")
    ap.add_argument("--model-bytes", type=int, default=0, help="its weights' bytes")
    ap.add_argument("--kv-bytes", type=int, default=0,
                    help="KV cache bytes a token reads at its context (kv_cache_bytes)")
    args = ap.parse_args(argv)
    if args.decode_ms is not None and args.model_bytes + args.kv_bytes <= 0:
        ap.error("--decode-ms needs --model-bytes and/or --kv-bytes")
    torch.set_num_threads(args.threads or os.cpu_count())
    result = {**provenance(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "cpu_model": cpu_model(), "cpu_flags": simd_flags(cpu_flags()),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "loadavg": loadavg(), "repeats": args.repeats, "convention":
              "GB = 1e9 bytes; copy/triad as STREAM counts them (2 and 3 x array bytes), "
              "and with the write-allocate read (3 and 4 x)"}
    with torch.inference_mode():
        result["bandwidth"] = measure(args.gib, args.repeats)
    if args.decode_ms is not None:
        result["decode"] = decode_efficiency(args.model_bytes + args.kv_bytes,
                                             args.decode_ms / 1e3,
                                             result["bandwidth"]["read"]["best_gbs"])
    print(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
