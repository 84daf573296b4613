"""The result table printed at the end of a run."""
from __future__ import annotations

from kvserve.benchmarks.client.metrics import METRICS

TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
WIDTH = 50

SUMMARY = [("Successful requests:", "completed", "{:d}"),
           ("Failed requests:", "failed", "{:d}"),
           ("Benchmark duration (s):", "duration", "{:.2f}"),
           ("Total input tokens:", "total_input_tokens", "{:d}"),
           ("Total generated tokens:", "total_output_tokens", "{:d}"),
           ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
           ("Request goodput (req/s):", "request_goodput", "{:.2f}"),
           ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
           ("Total token throughput (tok/s):", "total_token_throughput", "{:.2f}")]


def _line(label: str, value, fmt: str = "{:.2f}") -> str:
    shown = "-" if value is None else fmt.format(value)
    return f"{label:<40} {shown:<10}"


def _metric_lines(result: dict, name: str, percentiles) -> list[str]:
    lines = [f" {TITLES[name]} ".center(WIDTH, "-")]
    upper = name.upper()
    lines.append(_line(f"Mean {upper} (ms):", result.get(f"mean_{name}_ms")))
    lines.append(_line(f"Median {upper} (ms):", result.get(f"median_{name}_ms")))
    lines += [_line(f"P{p:g} {upper} (ms):", result.get(f"p{p:g}_{name}_ms"))
              for p in percentiles]
    return lines


def format_result(result: dict, percentiles=(99,)) -> str:
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines += [_line(label, result[key], fmt) for label, key, fmt in SUMMARY if key in result]
    for name in METRICS:
        lines += _metric_lines(result, name, percentiles)
    lines.append("=" * WIDTH)
    if result.get("tokens_in_unsized_chunks"):
        lines.append(f"note: {result['tokens_in_unsized_chunks']} tokens came in chunks of "
                     "several tokens of unknown size, so ITL counts those gaps per chunk "
                     "(--continuous-usage-stats on vLLM, or --extra-body "
                     "'{\"logprobs\": 0}', makes it per token)")
    if result.get("errors"):
        lines.append("errors (first few): " + " | ".join(result["errors"]))
    return "\n".join(lines)
