"""A vocabulary's table kept quantized (a GGUF's token_embd, and the LM head tied to
it): rows of integers with a scale (and minimum) per group of 32 or 16 inputs, as the
file's blocks hold them (w = q * scale + min, or a codebook's value at q times the
scale; exactly gguf's de-quantization).
The embedding looks up and expands only the rows it needs (the LM head, tied or not,
is a layer of its own: gguf_loader.py). Codes of 16 levels are stored two to a byte,
others one."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvserve.engine.models.quantized.group_scales import group_values
from kvserve.engine.platform.gguf_blocks import GroupQuant


class QuantizedTable(nn.Module):
    def __init__(self, blocks: GroupQuant, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.out_dtype = dtype
        self.num_rows, self.dim = blocks.q.shape
        self.group = blocks.group
        self.nibbles = blocks.fits_int4() and self.dim % 2 == 0
        if self.nibbles:
            blocks = blocks.shifted()
            q = blocks.q.astype(np.uint8).reshape(self.num_rows, -1, 2)
            q = q[..., 0] | (q[..., 1] << 4)  # inputs 2j (low nibble) and 2j + 1
        else:
            q = blocks.q.astype(np.int8)

        def tensor(values: np.ndarray | None) -> torch.Tensor | None:
            return None if values is None else torch.from_numpy(
                np.ascontiguousarray(values)).to(device)

        self.register_buffer("q", tensor(q))
        for name in ("scales", "mins", "scale_base", "min_base", "codebook"):
            self.register_buffer(name, tensor(getattr(blocks, name)))

    def _expand(self, ids: torch.Tensor | None) -> torch.Tensor:
        """The rows `ids` (all where None) as float32 [n, dim]."""
        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or ids is None else t[ids]

        q = rows(self.q)
        if self.nibbles:
            q = torch.stack([q & 15, q >> 4], dim=-1)
        q = q.reshape(q.shape[0], -1, self.group)
        values = self.codebook.float()[q.long()] if self.codebook is not None else q.float()
        w = values * group_values(rows(self.scales), rows(self.scale_base), 1)[..., None]
        if self.mins is not None:
            w = w + group_values(rows(self.mins), rows(self.min_base), 1)[..., None]
        return w.reshape(-1, self.dim)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., dim] in the model's dtype."""
        return self._expand(ids.reshape(-1)).to(self.out_dtype).reshape(*ids.shape, self.dim)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole table, [rows, dim] in `dtype` (tests, tools)."""
        return self._expand(None).to(dtype)


class QuantizedEmbedding(nn.Module):
    def __init__(self, table: QuantizedTable):
        super().__init__()
        self.table = table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(input_ids)
