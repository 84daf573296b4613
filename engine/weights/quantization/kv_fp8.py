"""An fp8 KV cache (--kv-cache-dtype fp8): every K and V value stored as one byte,
float8 e4m3 (4 exponent bits, 3 mantissa bits, largest 448), after division by a
scale of its layer's (one for K, one for V); readers multiply back. Half the bytes
of a bf16 cache: twice the blocks in the same memory, and half the bytes a decode
step reads per token of context.

e4m3 keeps about two significant digits over its whole range, so the scale only
has to keep the largest values inside it. Each layer's scales come from the model
itself at load: the calibration text (calibration.py) runs through it once, and the
layer's largest |K| and |V| there are mapped to FP8_MAX / HEADROOM. Values up to
HEADROOM times larger than any the calibration saw are still represented; beyond
that they saturate at +-448 x scale (stores clamp, so nothing becomes inf or NaN).
Without a tokenizer (a token-ids-only model) the scales are 1, as vLLM's are when a
checkpoint brings none.

Outliers: a few channels of the keys (after RoPE) are far larger than the rest, and
the queries are large in the same channels, so a score q.k is dominated by a few
products, each carrying its key's whole rounding error (up to 1/16). Queries and
keys are therefore both turned by one orthogonal matrix before the cache sees them
(QuaRot's idea, Ashkboos et al., 2024): q.k is unchanged, but every channel of a
turned key mixes all of the original ones, and the rounding errors of 64 similar
products average out. On the default model this takes fp8's perplexity cost from
~1% to ~0.3% (bench/results/quality_kv_fp8_*.json). The rotation is a normalised
Hadamard matrix where head_dim is a power of two, else a fixed random orthogonal
one; values are not turned (their error is small and averages over the context)."""
from __future__ import annotations

import logging

import torch
from torch import nn

from kvserve.engine.kernels.fp8_cache import FP8, FP8_MAX, key_rotation
from kvserve.engine.models.kv_caches import KVCacheFormat
from kvserve.engine.weights.quantization.calibration import (calibration_tokens,
                                                             run_calibration_prompt)
from kvserve.engine.models.quantized.layer import nonzero
from kvserve.modelstore.errors import ModelLoadError

log = logging.getLogger("kvserve.engine")

HEADROOM = 2.0
# fp8_e4m3 is vLLM's spelling of the same format.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_cache_format(name: str, model: nn.Module, tokenizer, device: torch.device,
                    dtype: torch.dtype) -> KVCacheFormat:
    """The cache format --kv-cache-dtype names; fp8 calibrates its scales here."""
    if name not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"unknown --kv-cache-dtype {name!r}; choose "
                             f"{', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return KVCacheFormat(dtype)
    if model.config.mla is not None:
        raise ModelLoadError("--kv-cache-dtype fp8 is not supported for latent attention "
                             "(DeepSeek) models, whose cache holds latents, not keys and "
                             "values; use --kv-cache-dtype auto")
    rotation = key_rotation(model.config.head_dim).to(device)
    scales = calibrate_scales(model, tokenizer, rotation, device, dtype)
    return KVCacheFormat(FP8, scales, rotation.to(dtype))


@torch.inference_mode()
def calibrate_scales(model: nn.Module, tokenizer, rotation: torch.Tensor,
                     device: torch.device, dtype: torch.dtype
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(k_scale, v_scale) per layer, float32 scalars on `device`; the keys' taken
    as the cache will hold them, turned by `rotation`."""
    attns = [layer.self_attn for layer in model.layers]
    if tokenizer is None:
        log.warning("--kv-cache-dtype fp8 without a tokenizer: no calibration text, "
                    "every layer's K/V scale is 1")
        return _pairs(torch.ones(len(attns), 2, device=device))
    run_calibration_prompt(model, calibration_tokens(tokenizer, "--kv-cache-dtype fp8"),
                           device, dtype)
    amax = torch.stack([torch.stack([(a.k_cache.float() @ rotation).abs().amax(),
                                     a.v_cache.abs().amax().float()]) for a in attns])
    scales = nonzero(amax / (FP8_MAX / HEADROOM))
    log.info("KV cache fp8 (e4m3): per-layer scales from the calibration text, K %.3g..%.3g, "
             "V %.3g..%.3g", *scales[:, 0].aminmax(), *scales[:, 1].aminmax())
    return _pairs(scales)


def _pairs(scales: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    # Each scalar a tensor of its own: a layer's pair is read by its layer alone.
    return tuple((row[0].clone(), row[1].clone()) for row in scales)
