"""Histogram bucket bounds: vLLM's, bound for bound, so that a vLLM dashboard, alert
or recording rule reads kvserve's histograms the same way (a histogram_quantile()
interpolates inside buckets, so other bounds would give other percentiles)."""
from __future__ import annotations

# Time to first token: 1 ms to 2,560 s.
TTFT_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)

# Inter-token latency: 10 ms to 80 s.
ITL_SECONDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# Whole-request spans (e2e, queue, prefill, decode): 0.3 s to 7,680 s.
REQUEST_SECONDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Compiling a grammar (kvserve's own: vLLM has no such histogram): 1 ms to 60 s.
COMPILE_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)

# One engine step's wall time (kvserve's own: vLLM has no such histogram): 1 ms to
# 10 s, a CPU's batch-1 decode step at the bottom, a long prompt chunk at the top.
STEP_SECONDS = (0.001, 0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

# Tokens one engine step computed.
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... while <= max_value: request lengths, bounded by the
    context length so no bucket is one no request can reach."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return bounds
            bounds.append(mantissa * scale)
        scale *= 10
