"""The paged KV cache's tensors on the device: one (K, V) pair per layer, which the
KV cache manager's block ids index; or, for a hybrid model (sliding-window layers
between full-attention ones), one pair per layer of a layer group, shared by the
groups (kvcache/hybrid.py: a block belongs to one group at a time). The target
model's runner and a draft model each attach their own."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.engine.models.decoder import DecoderModel
from kvserve.engine.models.pipeline_stage import held_layers

log = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class LayerGroups:
    """A hybrid model's cache layout, as vLLM's hybrid allocator lays it out: the
    full-attention layers are group 0; the sliding-window layers, in order, groups
    1, 2, ... of as many layers (the last may have fewer). Layer i reads and writes
    (K, V) pair `tensor[i]` through group `group[i]`'s block table; the j-th layer of
    every group shares pair j, so a block is one group's layers' K/V for block_size
    tokens."""
    tensor: tuple[int, ...]
    group: tuple[int, ...]
    num_tensors: int
    window: int  # the sliding layers' window

    @property
    def window_groups(self) -> int:
        return max(self.group)


def layer_groups(cfg, config=None) -> LayerGroups | None:
    """The layout for a model with both full-attention and sliding-window layers
    (Gemma 2/3, gpt-oss), else None (one pair per layer, one table). config: the
    EngineConfig, whose --disable-hybrid-kv-cache-manager keeps one table, as do
    early-exit drafts (they run the model's own first layers on a step of their
    own, over one table)."""
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    full = [i for i, w in enumerate(windows) if not w]
    sliding = [i for i, w in enumerate(windows) if w]
    if not full or not sliding or cfg.mla is not None:
        return None
    if config is not None and config.disable_hybrid_kv_cache_manager:
        return None
    spec = config.speculative if config is not None else None
    if spec is not None and spec.method == "early-exit":
        log.info("the sliding-window layers keep every block: early-exit drafts run "
                 "them on one block table")
        return None
    tensor, group = [0] * len(windows), [0] * len(windows)
    for j, i in enumerate(full):
        tensor[i] = j
    for j, i in enumerate(sliding):
        tensor[i], group[i] = j % len(full), 1 + j // len(full)
    return LayerGroups(tuple(tensor), tuple(group), len(full), max(windows))


@dataclass(frozen=True)
class KVCacheFormat:
    """How the cache holds K and V: as computed, in `dtype`; or, with `scales` (one
    (k_scale, v_scale) pair of float32 scalars per layer, engine/weights/quantization/
    kv_fp8.py), divided by the layer's scale and rounded to `dtype` (fp8 e4m3), the
    keys (and queries) first turned by the orthogonal `key_rotation` [D, D]."""
    dtype: torch.dtype
    scales: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    key_rotation: torch.Tensor | None = None

    def bytes_per_block(self, cfg, block_size: int, groups: LayerGroups | None = None) -> int:
        """One block's bytes: every layer's, or with `groups` one group's."""
        tensors, heads, dim = cfg.kv_cache_dims()
        layers = groups.num_tensors if groups is not None else cfg.num_layers
        return tensors * layers * block_size * heads * dim * self.dtype.itemsize


def attach_kv_caches(model: DecoderModel, num_blocks: int, block_size: int,
                     fmt: KVCacheFormat, device: torch.device,
                     groups: LayerGroups | None = None) -> list[tuple]:
    """A paged (K, V) pair per layer (per layer of a group with `groups`), zeroed,
    and each layer's attention pointed at its pair, its scales and its group's
    block table: [(k, v)], each [num_blocks, block_size, kv_heads, head_dim]. With
    latent attention K and V are one tensor, [num_blocks, block_size, 1, latent +
    rotary key] (engine/models/mla.py)."""
    held = held_layers(model)  # a pipeline stage's own (all of them without)
    cfg, attn = model.config, held[0][1].self_attn
    tensors, _, dim = cfg.kv_cache_dims()
    # The KV heads this tensor-parallel rank holds (all of them at one rank).
    shape = (num_blocks, block_size, attn.num_kv_heads, dim)

    def zeros():
        return torch.zeros(shape, dtype=fmt.dtype, device=device)

    count = groups.num_tensors if groups is not None else len(held)
    caches = [(zeros(), zeros()) if tensors == 2 else (z := zeros(), z)
              for _ in range(count)]
    for j, (i, layer) in enumerate(held):
        attn = layer.self_attn
        attn.k_cache, attn.v_cache = caches[groups.tensor[i] if groups is not None else j]
        attn.kv_group = groups.group[i] if groups is not None else 0
        attn.kv_scales = fmt.scales[i] if fmt.scales else None
        attn.key_rotation = fmt.key_rotation
    return caches


def copy_blocks(caches: list[tuple], copies: list[tuple[int, int, int]]) -> None:
    """Copy-on-write: each (src block, dst block, tokens) copies the first `tokens`
    slots of src's K and V to dst, in every (k, v) pair of `caches`."""
    for src, dst, num_tokens in copies:
        for k, v in caches:
            k[dst, :num_tokens] = k[src, :num_tokens]
            if v is not k:  # (latent attention's one tensor)
                v[dst, :num_tokens] = v[src, :num_tokens]
