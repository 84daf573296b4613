"""Embedding requests (SamplingParams.pooling): the final hidden states of a prompt
pooled into one normalised vector, as the step computes them.

A pooling request is scheduled like any prompt (chunked, batched with generation)
and samples one throwaway token at its end, which finishes it (max_tokens 1): no
decode step, and its blocks are freed with it. The runner hands each of its chunks'
hidden rows here; "mean" sums them chunk by chunk (a prefix-cache hit would skip
rows, so such requests compute their whole prompt), "last" keeps the last row. The
vector is ready on the device when the last chunk ran, and reaches the host with the
step's sampled tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.scheduler.output import ScheduledRequest


@dataclass
class PoolRows:
    """One scheduled pooling request's rows in this step's flat batch."""
    request_id: str
    method: str
    first_row: int
    num_rows: int
    restarts: bool  # its prompt starts over here (first chunk, or after preemption)
    completes: bool  # the prompt's last chunk: the vector is ready after this step


class Pooler:
    def __init__(self):
        self._sums: dict[str, torch.Tensor] = {}  # "mean": the rows so far, float32

    def observe(self, hidden: torch.Tensor, items: list[PoolRows]) -> dict[str, torch.Tensor]:
        """Takes this step's rows; returns the vectors completed by it (on the
        device, float32, unit length)."""
        done = {}
        for it in items:
            end = it.first_row + it.num_rows
            if it.method == "last":  # only the prompt's very last row matters
                pooled = hidden[end - 1].float() if it.completes else None
            else:
                total = hidden[it.first_row:end].float().sum(dim=0)
                if not it.restarts and it.request_id in self._sums:
                    total = total + self._sums[it.request_id]
                self._sums[it.request_id] = total
                pooled = None
                if it.completes:
                    pooled = self._sums.pop(it.request_id)
            if pooled is not None:
                done[it.request_id] = torch.nn.functional.normalize(pooled, dim=0)
        return done

    def release(self, request_id: str) -> None:
        self._sums.pop(request_id, None)


def pool_rows(scheduled: list[ScheduledRequest], query_starts: list[int]) -> list[PoolRows]:
    """The embedding requests' rows of a step whose requests start at query_starts."""
    return [PoolRows(s.request.request_id, s.request.params.pooling, query_starts[i],
                     s.num_new_tokens, restarts=s.start == 0, completes=s.samples)
            for i, s in enumerate(scheduled) if s.request.params.pooling]
