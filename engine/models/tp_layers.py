"""The model's layers that talk to the other tensor-parallel ranks. At one rank they
are plain linear layers (engine/models/linear.py's) and nn.Embedding
(quantization may replace them as such)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.kernels.cpu.packing import PackedWeight
from kvserve.engine.models import tp_comm as comm
from kvserve.engine.models.linear import Linear


class RowParallelLinear(Linear):
    """Holds the rank's input columns: the ranks' partial products are summed by one
    all-reduce, and the bias (every rank holds it) added once, after it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if comm.shard().size == 1:
            return super().forward(x)
        y = comm.all_reduce(self.product(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Holds the rows [start, start + num_embeddings) of the vocabulary: a token
    outside them looks up zeros here and its row on another rank; the all-reduce
    adds them up."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int = 0):
        super().__init__(num_embeddings, embedding_dim)
        self.start = start
        self.packed: PackedWeight | None = None

    def read_packed(self, packed: PackedWeight) -> None:
        """Rows from now on looked up in a tied LM head's packed weight
        (engine/kernels/cpu/packing.py), and the table of its own let go."""
        self.packed = packed
        self.rows_dtype = self.weight.dtype  # the panels give float32 rows
        self.weight = None

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(ids, self.weight)
        return self.packed.rows(ids).to(self.rows_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if comm.shard().size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = self.lookup(local.masked_fill(outside, 0))
        return comm.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))
