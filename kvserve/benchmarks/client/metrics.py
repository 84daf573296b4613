"""Benchmark metrics with vLLM's definitions and vLLM's result key names (mean_ttft_ms,
p99_itl_ms, output_throughput, ...), so tools that read `vllm bench serve` results
read these too. Failed requests count only in `failed`."""
from __future__ import annotations

import math
import statistics

from kvserve.benchmarks.client.records import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * p / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(name: str, seconds: list[float], percentiles) -> dict:
    """mean/median/std/pXX of one metric, in ms; None when nothing was measured."""
    ms = [s * 1000 for s in seconds]
    row = {f"mean_{name}_ms": statistics.fmean(ms) if ms else None,
           f"median_{name}_ms": statistics.median(ms) if ms else None,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else None}
    for p in percentiles:
        row[f"p{p:g}_{name}_ms"] = percentile(ms, p) if ms else None
    return row


def samples(done: list[RequestRecord]) -> dict[str, list[float]]:
    return {"ttft": [r.ttft for r in done],
            "tpot": [t for r in done if (t := r.tpot()) is not None],
            "itl": [gap for r in done for gap in r.itls()],
            "e2el": [r.e2el for r in done]}


def meets_slos(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Every given SLO met. As in vLLM, a one-token output has TPOT 0."""
    value = {"ttft": r.ttft, "tpot": r.tpot() or 0.0, "e2el": r.e2el}
    return all(value[k] * 1000 <= limit for k, limit in slos_ms.items())


def summarize(records: list[RequestRecord], duration: float, percentiles=(99,),
              slos_ms: dict[str, float] | None = None) -> dict:
    done = [r for r in records if r.success]
    inputs, outputs = sum(r.prompt_tokens for r in done), sum(r.output_tokens for r in done)
    per_s = 1 / duration if duration > 0 else 0.0
    out = {"completed": len(done), "failed": len(records) - len(done), "duration": duration,
           "total_input_tokens": inputs, "total_output_tokens": outputs,
           "request_throughput": len(done) * per_s, "output_throughput": outputs * per_s,
           "total_token_throughput": (inputs + outputs) * per_s}
    if slos_ms:
        out["request_goodput"] = sum(meets_slos(r, slos_ms) for r in done) * per_s
    # Tokens the usage counted beyond what the chunks said they carried: a plain
    # stream does not say how many tokens a chunk holds, so those gaps are per chunk.
    out["tokens_in_unsized_chunks"] = sum(max(0, r.output_tokens - sum(r.chunk_tokens))
                                          for r in done)
    for name, values in samples(done).items():
        out.update(distribution(name, values, percentiles))
    out["errors"] = sorted({r.error for r in records if not r.success})[:5]
    return out
