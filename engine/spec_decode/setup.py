"""Speculative decoding's parts, built from --speculative-method and the flags beside
it: the speculator that proposes drafts, and what fills its placeholder drafts before
a step (the model's first layers, or a draft model; none for ngram, whose drafts are
tokens)."""
from __future__ import annotations

import logging

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.models.kv_caches import KVCacheFormat
from kvserve.engine.spec_decode.drafters import DraftModelDrafter, EarlyExitDrafter
from kvserve.engine.spec_decode.speculator import Speculator
from kvserve.engine.weights.cpu_packing import pack_model
from kvserve.engine.weights.loader import ModelLoadError, load_model

log = logging.getLogger("kvserve.engine")


def make_speculator(config: EngineConfig) -> Speculator | None:
    spec = config.speculative
    if spec is None:
        return None
    log.info("speculative decoding: %s, %d tokens, off above %s running", spec.method,
             spec.num_tokens, spec.disable_batch_size or "no limit")
    return Speculator(spec)


def make_drafter(ctx, model, backend):
    """The drafter of --speculative-method, or None. ctx: the engine's EngineContext
    (engine/core/build.py): its config, device, dtype, model facts and cache size."""
    spec, config = ctx.config.speculative, ctx.config
    if spec is not None and spec.method == "early-exit":
        return EarlyExitDrafter(model, backend, config.block_size, ctx.device,
                                spec.draft_layers)
    if spec is None or spec.method != "draft":
        return None
    cfg = ModelConfig.from_pretrained(spec.model)
    if cfg.vocab_size != ctx.model_config.vocab_size:
        raise ModelLoadError(f"the draft model's vocabulary ({cfg.vocab_size} tokens) "
                             f"is not the model's ({ctx.model_config.vocab_size})")
    draft = load_model(spec.model, cfg, ctx.dtype, ctx.device, ctx.max_model_len,
                       config.load_format, config.seed + 1)
    pack_model(draft, config.cpu_kernels, ctx.device, ctx.dtype)
    # The draft's own cache stays in the model dtype: it has no calibrated scales.
    return DraftModelDrafter(draft, ctx.num_blocks, backend, config.block_size, ctx.device,
                             KVCacheFormat(ctx.dtype))
