"""When torch's CPU kernels for quantized weights take a step's rows: they read the
quantized bytes directly and pay only for a few rows (int8.py, int4.py)."""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true


def few_rows(x: torch.Tensor, limit: int) -> bool:
    """At most `limit` rows, known now: a compiled graph with a dynamic token count
    (mixed steps) takes the other path for every size, so no guard on the count
    splits it into a graph per side of the limit (a recompilation mid-serving)."""
    return statically_known_true(x.shape[0] <= limit)
