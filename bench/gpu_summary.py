"""A short table from bench/gpu_decode.py (or `kvserve bench decode --json`) results:
what bench/gpu_session.sh prints last, so it is what the device tool's reply shows. A
result cut short by a time limit still has its earlier phases; missing numbers print
as '-'.

Usage: python bench/gpu_summary.py RESULT.json [RESULT.json ...]
       python bench/gpu_summary.py $OUT/results.json   (a session's, every stage)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = [  # (header, path into the result, scale)
    ("copy GB/s", "copy_bandwidth.gbps", 1),
    ("weights GB", "weight_bytes", 1e-9),
    ("ours load peak GB", "kvserve.load_peak_bytes", 1e-9),
    ("ours tok/s", "kvserve.decode.tok_s", 1),
    ("ours MBU", "kvserve.decode.mbu", 1),
    ("ours TTFT ms", "kvserve.ttft.median_s", 1e3),
    ("ours MFU", "kvserve.prefill.mfu", 1),
    ("ours prefill ms", "kvserve.split.prefill_s", 1e3),
    ("ours decode ms/tok", "kvserve.split.decode_ms_per_token", 1),
    ("hf tok/s", "transformers.decode.tok_s", 1),
    ("hf MBU", "transformers.decode.mbu", 1),
    ("hf TTFT ms", "transformers.ttft.median_s", 1e3),
    ("hf batch tok/s", "transformers.generate_batch.tok_s", 1),
    ("x decode", "ratios_kvserve_over_transformers.decode_tok_s", 1),
    ("x TTFT", "ratios_kvserve_over_transformers.ttft", 1),
    ("profiled ms/step", "kvserve.profile.wall_ms_per_step", 1),
    ("GPU busy ms", "kvserve.profile.device_busy_ms", 1),
    ("host share", "kvserve.profile.host_share", 1),
    ("kernels/step", "kvserve.profile.kernels_per_step", 1),
]
TOP_KERNELS = 3  # a profiled result's costliest kernels, a line each


SCALARS = 12  # a result of another benchmark: its first numbers, on one line


def lookup(result: dict, path: str, scale: float) -> str:
    value = result
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return "-"
        value = value[key]
    return f"{value * scale:.3g}" if isinstance(value, (int, float)) else "-"


def result_lines(result: dict, title: str | None = None, compact: bool = True) -> list[str]:
    """Two lines for one result: what ran where, then its figures (compact: those it
    has; else every column, '-' where missing). A result of another benchmark
    (bench/step_overhead.py, bench/lora_overhead.py) shows its top-level numbers."""
    name = result.get("preset") or result.get("model") or "?"
    head = f"{name} {result.get('dtype', '?')} on {result.get('device', '?')}"
    head = f"{title}: {head}" if title else head
    if "kvserve" not in result and "copy_bandwidth" not in result:
        numbers = [(k, v) for k, v in result.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return [head, "  " + " | ".join(f"{k}: {v:.4g}" for k, v in numbers[:SCALARS])]
    cells = [(h, lookup(result, p, s)) for h, p, s in COLUMNS]
    if compact:
        cells = [(h, c) for h, c in cells if c != "-"]
    kernels = result.get("kvserve", {}).get("profile", {}).get("top_kernels", [])
    return [head, "  " + " | ".join(f"{h}: {c}" for h, c in cells)] + [
        f"    {k['ms_per_step']:.3f} ms x{k['calls_per_step']:.3g} {k['name'][:90]}"
        for k in kernels[:TOP_KERNELS]]


def main(paths: list[str]) -> None:
    """Each file: a bench/gpu_decode.py result, or bench/gpu_session.py's results.json
    (every run of every stage)."""
    for path in paths:
        try:
            r = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"{path}: no result ({exc})")
            continue
        if "stages" in r:
            for stage, st in r["stages"].items():
                for label, run in st.get("runs", {}).items():
                    if "result" in run:
                        print("\n".join(result_lines(run["result"], f"{stage} {label}".strip())))
            continue
        print("\n".join(result_lines(r, compact=False)))


if __name__ == "__main__":
    main(sys.argv[1:])
