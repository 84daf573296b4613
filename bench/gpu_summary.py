"""A short table from bench/gpu_decode.py (or `kvserve bench decode --json`) results:
what bench/gpu_session.sh prints last, so it is what the device tool's reply shows. A
result cut short by a time limit still has its earlier phases; missing numbers print
as '-'.

Usage: python bench/gpu_summary.py RESULT.json [RESULT.json ...]
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
]


def lookup(result: dict, path: str, scale: float) -> str:
    value = result
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return "-"
        value = value[key]
    return f"{value * scale:.3g}" if isinstance(value, (int, float)) else "-"


def main(paths: list[str]) -> None:
    rows = []
    for path in paths:
        try:
            r = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"{path}: no result ({exc})")
            continue
        name = r.get("preset") or r.get("model") or "?"
        head = f"{name} {r.get('dtype', '?')} on {r.get('device', '?')}"
        rows.append((head, [lookup(r, p, s) for _, p, s in COLUMNS]))
    for head, cells in rows:
        print(head)
        print("  " + " | ".join(f"{h}: {c}" for (h, _, _), c in zip(COLUMNS, cells)))


if __name__ == "__main__":
    main(sys.argv[1:])
