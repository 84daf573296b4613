"""torch's intra-op thread count changed for a block and put back after it, for tests
that run a CPU kernel on several thread counts (its work shared differently)."""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
