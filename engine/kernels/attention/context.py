"""One attention context per forward pass (as nano-vllm does), so the model code does
not thread batch metadata through every layer. The model runner builds the
backend-agnostic metadata once per step, hands it to the attention backend's
`prepare`, and sets the backend and the result here; every attention layer calls
`paged_attention`, which reads them.

`paged_attention` is a registered custom op (`torch.ops.kvserve.paged_attention`):
torch.compile sees one opaque call per layer and compiles the rest of the decoder
around it (vLLM's piecewise split), so the step's metadata never enters a compiled
graph and no shape of it causes a recompilation. The context is per thread: the
compiler warms its graphs up on a thread of its own while steps run eagerly."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class AttentionMetadata:
    """What every backend needs about one step, on the model's device.

    Requests are ordered decodes first: requests [0, num_decodes) compute exactly one
    token each (rows 0..num_decodes-1 of the flat batch), the rest compute more. A
    request's query tokens are the last `query_len` tokens of its `seq_len` context,
    so query i sits at position seq_len - query_len + i and sees keys 0..that one."""

    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token (-1: padding, skip)
    query_start_loc: torch.Tensor  # [R + 1] int32 first row of each request, then T
    seq_lens: torch.Tensor  # [R] int32 context length, this step's tokens included
    block_tables: torch.Tensor  # [R, max_blocks] int32, padded with 0
    # Host copies of the two small vectors, for backends that plan on the host
    # without waiting for the device. seq_lens_cpu is None inside a CUDA graph
    # capture (the graph must hold for any lengths up to max_seq_len).
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor | None
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_prefills: int
    num_tokens: int
    block_size: int
    # A hybrid model's sliding-window layer groups: the same step over each group's
    # own block tables and cache slots, group 1 first (kvcache/hybrid.py); ().
    groups: tuple[AttentionMetadata, ...] = ()

    @property
    def num_reqs(self) -> int:
        return self.num_decodes + self.num_prefills


class GroupSteps(tuple):
    """A hybrid model's step as its backend prepared it for each layer group's
    tables (index: the group; a layer's `kv_group` picks its own)."""


def prepare_step(backend: Any, common: AttentionMetadata) -> Any:
    """backend.prepare(common), for every layer group where the model has several."""
    meta = backend.prepare(common)
    if not common.groups:
        return meta
    return GroupSteps((meta, *(backend.prepare(g) for g in common.groups)))


_local = threading.local()  # .current: (backend, what its prepare returned) or None


def set_attention_context(backend: Any, meta: Any) -> None:
    _local.current = (backend, meta)


def clear_attention_context() -> None:
    _local.current = None


def _current() -> tuple[Any, Any]:
    current = getattr(_local, "current", None)
    if current is None:
        raise RuntimeError("attention called outside a model runner step")
    return current


def get_attention_metadata() -> Any:
    """What the step's backend `prepare` returned."""
    return _current()[1]


def get_attention_backend() -> Any:
    """The step's backend."""
    return _current()[0]


@torch.library.custom_op("kvserve::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                    k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None, window: int = 0,
                    softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                    kv_group: int = 0) -> torch.Tensor:
    """The attention call of every layer: stores the new tokens' K/V and attends,
    through the step's backend. q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D].
    k_scale, v_scale: the layer's fp8 cache scales (None: a cache in the model dtype).
    window (a sliding window's keys, 0: all), softcap (0.0: none), sinks ([Hq] logits,
    None: none): what some families add (engine/kernels/attention/score_mods.py).
    kv_group: the layer group whose block tables the layer's cache is read by."""
    backend, meta = _current()
    if type(meta) is GroupSteps:
        meta = meta[kv_group]
    elif kv_group:  # the full group's slots would land in another group's blocks
        raise RuntimeError("a layer of a hybrid cache's group was run on a step "
                           "prepared for one block table (use prepare_step)")
    return backend.forward(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale,
                           window, softcap, sinks)


@paged_attention.register_fake
def _paged_attention_shape(q, k, v, k_cache, v_cache, scale, k_scale=None, v_scale=None,
                           window=0, softcap=0.0, sinks=None, kv_group=0):
    return torch.empty_like(q)
