"""The paged KV cache's tensors on the device: one (K, V) pair per layer, which the
KV cache manager's block ids index. The target model's runner and a draft model
each attach their own."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.models.decoder import DecoderModel


@dataclass(frozen=True)
class KVCacheFormat:
    """How the cache holds K and V: as computed, in `dtype`; or, with `scales` (one
    (k_scale, v_scale) pair of float32 scalars per layer, engine/weights/quantization/
    kv_fp8.py), divided by the layer's scale and rounded to `dtype` (fp8 e4m3), the
    keys (and queries) first turned by the orthogonal `key_rotation` [D, D]."""
    dtype: torch.dtype
    scales: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    key_rotation: torch.Tensor | None = None

    def bytes_per_block(self, cfg, block_size: int) -> int:
        tensors, heads, dim = cfg.kv_cache_dims()
        return tensors * cfg.num_layers * block_size * heads * dim * self.dtype.itemsize


def attach_kv_caches(model: DecoderModel, num_blocks: int, block_size: int,
                     fmt: KVCacheFormat, device: torch.device) -> list[tuple]:
    """A paged (K, V) pair per layer, zeroed, and each layer's attention pointed at
    its pair and its scales: [(k, v)], each [num_blocks, block_size, kv_heads,
    head_dim]. With latent attention K and V are one tensor, [num_blocks,
    block_size, 1, latent + rotary key] (engine/models/mla.py)."""
    cfg, attn = model.config, model.layers[0].self_attn
    tensors, _, dim = cfg.kv_cache_dims()
    # The KV heads this tensor-parallel rank holds (all of them at one rank).
    shape = (num_blocks, block_size, attn.num_kv_heads, dim)

    def zeros():
        return torch.zeros(shape, dtype=fmt.dtype, device=device)

    caches = [(zeros(), zeros()) if tensors == 2 else (z := zeros(), z)
              for _ in range(cfg.num_layers)]
    for i, (layer, (k, v)) in enumerate(zip(model.layers, caches)):
        layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
        layer.self_attn.kv_scales = fmt.scales[i] if fmt.scales else None
        layer.self_attn.key_rotation = fmt.key_rotation
    return caches


def copy_blocks(caches: list[tuple], copies: list[tuple[int, int, int]]) -> None:
    """Copy-on-write: each (src block, dst block, tokens) copies the first `tokens`
    slots of src's K and V to dst, in every (k, v) pair of `caches`."""
    for src, dst, num_tokens in copies:
        for k, v in caches:
            k[dst, :num_tokens] = k[src, :num_tokens]
            if v is not k:  # (latent attention's one tensor)
                v[dst, :num_tokens] = v[src, :num_tokens]
