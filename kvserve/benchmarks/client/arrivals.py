"""When requests (sessions) start: all at once, a Poisson process, or a gamma process.

A gamma process with shape k and mean interval 1/rate has scale 1/(rate*k): k = 1 is
Poisson, k < 1 is burstier (clumps and gaps), k > 1 is more even. vLLM's --burstiness
means the same thing."""
from __future__ import annotations

import itertools
import math
import random


def intervals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n gaps in seconds between consecutive requests."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]


def start_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the benchmark's start at which each request is sent. Sleeping until
    an absolute time keeps timer slack from adding up over a long run. The first
    request goes at once, as in vLLM."""
    gaps = intervals(max(n - 1, 0), rate, burstiness, seed)
    return list(itertools.accumulate(gaps, initial=0.0))[:n]
