"""The interface every attention backend implements.

A backend sees one layer's query and new keys/values of a flat batch, the layer's
paged cache, and the step's metadata. `prepare` runs once per step (before the
first layer), so per-step work such as index building or split planning is shared
by all layers."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from kvserve.engine.kernels.attention.context import AttentionMetadata


class AttentionBackend(ABC):
    name: str = ""
    # True when prepare() works from device tensors and max_seq_len alone (no host
    # copies of the lengths) and forward() never syncs: decode steps can then be
    # captured in a CUDA graph.
    graph_safe: bool = False
    # True when a decode-only step's attention can be traced into a compiled graph,
    # its inputs (traced_decode) taken as graph inputs (the torch backend's paged
    # decode, on CPU).
    traces_paged_decode: bool = False

    def prepare(self, common: AttentionMetadata) -> Any:
        """Per-step metadata of this backend; by default the common one as is."""
        return common

    def in_place_reader(self) -> AttentionBackend:
        """This backend reading K/V where they lie in the cache, where it has such a
        path (what compiled steps use); by default itself."""
        return self

    def traced_decode(self, meta: Any) -> Any:
        """A step's inputs for a compiled graph with the attention traced in, if
        every row of it is such a decode (traces_paged_decode); else None."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                scale: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Writes k, v [T, Hkv, D] into the cache at meta's slots (skipping slot -1),
        then returns attention of q [T, Hq, D] over each request's context: [T, Hq, D].
        The caches are [num_blocks, block_size, Hkv, D]. With k_scale and v_scale
        (float32 scalars) the caches are fp8: K/V are stored divided by them
        (engine/weights/quantization/kv_fp8.py) and read multiplied back. window,
        softcap and sinks: a sliding window, logit soft-cap and attention sinks
        (score_mods.py; 0, 0.0 and None: plain attention)."""
