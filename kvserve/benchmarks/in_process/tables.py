"""Plain-text tables of the results of decode.py and offline.py."""
from __future__ import annotations


def cell(value, spec: str = ".3g", scale: float = 1.0) -> str:
    """A number formatted, '-' for a missing one."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return format(value * scale if scale != 1 else value, spec)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """First column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]),
                      *(line(r) for r in rows)])


def _get(row: dict | None, *path: str):
    for key in path:
        if not isinstance(row, dict) or key not in row:
            return None
        row = row[key]
    return row


def _headline(r: dict) -> str:
    return (f"{r.get('model')} ({r.get('load_format')}), {r.get('dtype')} on "
            f"{r.get('device')}, commit {r.get('commit') or '?'}")


def decode_table(r: dict) -> str:
    sides = [("kvserve", r.get("kvserve"))]
    if "transformers" in r:
        sides.append(("transformers", r["transformers"]))
    w = r.get("workloads", {})
    prompt = _get(r, "kvserve", "prefill", "tokens")
    spec = [  # (label, path, scale, format)
        ("decode tok/s (batch 1)", ("decode", "tok_s"), 1, ".4g"),
        ("decode step ms", ("decode", "step_ms"), 1, ".4g"),
        ("bytes read per step (MB)", ("decode", "bytes_read_per_step"), 1e-6, ".4g"),
        ("MBU (of copy bandwidth)", ("decode", "mbu"), 1, ".3g"),
        (f"prefill tok/s ({prompt} tokens)", ("prefill", "tok_s"), 1, ".4g"),
        ("prefill TFLOP/s", ("prefill", "achieved_tflops"), 1, ".3g"),
        ("MFU (of peak FLOP/s)", ("prefill", "mfu"), 1, ".3g"),
        ("TTFT ms", ("ttft", "median_s"), 1e3, ".4g"),
        ("split: prefill ms", ("split", "prefill_s"), 1e3, ".4g"),
        ("split: decode ms", ("split", "decode_s"), 1e3, ".4g"),
        ("split: decode share", ("split", "decode_share"), 1, ".3f"),
        ("split: decode ms/token", ("split", "decode_ms_per_token"), 1, ".4g"),
    ]
    rows = [[label, *(cell(_get(row, *path), fmt, scale) for _, row in sides)]
            for label, path, scale, fmt in spec]
    out = [f"kvserve bench decode: {_headline(r)}",
           format_table(["", *(name for name, _ in sides)], rows),
           f"copy bandwidth {cell(_get(r, 'copy_bandwidth', 'gbps'), '.4g')} GB/s "
           f"(read + written); peak {cell(_get(r, 'peak_flops', 'tflops'), '.4g')} "
           f"TFLOP/s ({_get(r, 'peak_flops', 'source')})"]
    out += [f"{k}: {v}" for k, v in w.items()]
    ratio = _get(r, "ratios_kvserve_over_transformers")
    if ratio:
        out.append("kvserve / transformers: " + ", ".join(
            f"{k} {cell(v, '.3g')}x" for k, v in ratio.items()))
    return "\n".join(out)


def offline_table(r: dict) -> str:
    c = r.get("config", {})
    rows = [["requests", cell(r.get("num_requests"), "d")],
            ["elapsed s", cell(r.get("elapsed_s"), ".4g")],
            ["requests/s", cell(r.get("requests_per_s"), ".4g")],
            ["output tokens/s", cell(r.get("output_tokens_per_s"), ".4g")],
            ["total tokens/s", cell(r.get("total_tokens_per_s"), ".4g")],
            ["input tokens", cell(r.get("input_tokens"), "d")],
            ["output tokens", cell(r.get("output_tokens"), "d")],
            ["engine steps", cell(r.get("engine_steps"), "d")]]
    return "\n".join([
        f"kvserve bench offline: {_headline(r)}",
        f"{c.get('num_prompts')} prompts of {c.get('input_len')} random token ids, "
        f"{c.get('output_len')} new tokens each (ignore_eos, temperature "
        f"{c.get('temperature')}); max_num_seqs {c.get('max_num_seqs')}, "
        f"max_num_batched_tokens {c.get('max_num_batched_tokens')}, "
        f"{c.get('num_kv_blocks')} KV blocks of {c.get('block_size')}",
        format_table(["", "value"], rows)])
