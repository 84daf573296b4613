"""Builds an engine's parts from its config. What they all depend on is worked out
once, in order (device and dtype, the model and its KV cache format, the cache's
size and the context length it leaves), into a frozen EngineContext; each part is
then made from that context with keyword arguments, none from a half-built engine
and none changed after it is made."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.core.kv_events import make_publisher
from kvserve.engine.kernels.attention.selector import check_layers_fit, make_backend
from kvserve.engine.kernels.cpu.build import c_compiler
from kvserve.engine.kv_offload.build import make_kv_tier
from kvserve.engine.lora.manager import LoRAManager
from kvserve.engine.models import tp_comm as comm
from kvserve.engine.models.kv_caches import KVCacheFormat, LayerGroups, layer_groups
from kvserve.modelstore.errors import ModelLoadError
from kvserve.engine.platform.device import resolve_device, resolve_dtype
from kvserve.engine.models.pipeline_stage import WHOLE, stage_of
from kvserve.engine.ranks.group import TensorParallelGroup, start_group
from kvserve.engine.ranks.pipeline import PipelineGroup, start_pipeline
from kvserve.engine.runner.compile_process import use_cache_dir
from kvserve.engine.core.package_build_process import build_in_child
from kvserve.engine.runner.cuda_graphs import DecodeGraphPlan
from kvserve.engine.runner.memory_budget import log_kv_cache, num_kv_blocks
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.engine.spec_decode.setup import make_drafter, make_speculator
from kvserve.engine.spec_decode.speculator import Speculator
from kvserve.engine.structured.compiler import GrammarCompiler
from kvserve.engine.structured.gate import GrammarGate
from kvserve.engine.structured.matchers import Matchers
from kvserve.engine.weights.model_setup import load_served_model
from kvserve.modelstore.default_model import cache_root
from kvserve.modelstore.tokenizer import has_tokenizer, load_tokenizer
from kvserve.scheduler.config import KVCacheConfig, SchedulerConfig
from kvserve.scheduler.scheduler import Scheduler

log = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class EngineContext:
    """The facts every part is built from, each decided once."""
    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    tokenizer: object | None  # None: a preset or config-only directory (token ids only)
    eos_token_ids: tuple[int, ...]
    kv_format: KVCacheFormat
    num_blocks: int
    max_model_len: int  # capped by the model, --max-model-len and the cache's size
    # A hybrid model's cache layout (kvcache/hybrid.py), None: one block a table
    layer_groups: LayerGroups | None = None


@dataclass(frozen=True)
class EngineParts:
    context: EngineContext
    runner: ModelRunner
    scheduler: Scheduler
    tp: TensorParallelGroup | None  # the other tensor-parallel ranks; None at one rank
    pipeline: PipelineGroup | None  # the pipeline stages before ours; None at one stage
    lora: LoRAManager | None  # None: LoRA off
    grammars: GrammarGate | None  # None: no tokenizer to build grammars over
    kv_events: object | None  # the KV cache events' publisher (--kv-events-config)
    speculator: Speculator | None


def build_engine(config: EngineConfig, tokenizer=None) -> EngineParts:
    config = _local_model(config)
    model_config = ModelConfig.from_pretrained(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    max_model_len = config.context_cap(model_config)
    tokenizer = _tokenizer(config, tokenizer)
    torch.manual_seed(config.seed)
    # Tensor parallelism: the other ranks start loading their parts beside ours.
    tp = start_group(config, model_config, device, dtype, max_model_len)
    # Pipeline stages: ours is the last, the others start loading theirs beside it.
    pipeline = start_pipeline(config, model_config, device, dtype, max_model_len)
    stage = pipeline.stage if pipeline is not None else WHOLE
    model, kv_format = load_served_model(config, model_config, tokenizer, device, dtype,
                                         max_model_len, comm.shard(), stage)
    # Before the KV cache is sized: the adapter slots' memory is not the cache's.
    lora = (LoRAManager(config.lora, model_config, device, dtype)
            if config.lora is not None else None)
    kv_view = comm.shard().kv_view(model_config)  # the KV heads this process's cache holds
    if pipeline is not None:  # and the layers: the most any stage has
        kv_view = dataclasses.replace(kv_view, num_layers=max(
            stage_of(model_config, i, stage.size).num_layers for i in range(stage.size)))
    groups = layer_groups(model_config, config)
    num_blocks = num_kv_blocks(config, kv_view, model, device, dtype, kv_format, groups)
    for group in (tp, pipeline):
        if group is not None:
            group.share_num_blocks(num_blocks)
    ctx = EngineContext(
        config=config, model_config=model_config, device=device, dtype=dtype,
        tokenizer=tokenizer, eos_token_ids=_eos_ids(model_config, tokenizer),
        kv_format=kv_format, num_blocks=num_blocks, layer_groups=groups,
        max_model_len=min(max_model_len,
                          _cache_context(config, model_config, num_blocks, groups)))
    matchers = Matchers(model_config.vocab_size) if tokenizer is not None else None
    runner = _runner(ctx, model, lora, tp, matchers, pipeline)
    _start_compiling(ctx, runner, tp or pipeline)
    kv_events = make_publisher(config.kv_events_config)
    if config.async_scheduling and device.type != "cuda":
        log.warning("async scheduling on %s overlaps nothing (the forward pass runs "
                    "on the host) and reports each step one step later", device.type)
    log_kv_cache(num_blocks, config.block_size, kv_format, kv_view, ctx.max_model_len, groups)
    tier = make_kv_tier(config, runner, tp is not None, pipeline is not None,
                        groups is not None, ctx.max_model_len)
    return EngineParts(context=ctx, runner=runner, tp=tp, pipeline=pipeline, lora=lora,
                       grammars=_grammar_gate(ctx, matchers),
                       scheduler=_scheduler(ctx, kv_events is not None, tier),
                       kv_events=kv_events, speculator=make_speculator(config))


def _tokenizer(config: EngineConfig, given):
    """A preset or a config-only directory has no tokenizer: the engine then takes and
    returns token ids only, and stops on the config's eos ids."""
    if given is None and has_tokenizer(config.model):
        given = load_tokenizer(config.model)
    if given is None:
        log.info("%s has no tokenizer: token ids only", config.model)
    return given


def _local_model(config: EngineConfig) -> EngineConfig:
    """config with a hub id --model replaced by its snapshot in the hub cache
    (fetched if need be, once, before anything reads the model)."""
    from kvserve.modelstore import hub

    if config.model is None or not hub.is_hub_id(config.model):
        return config
    return dataclasses.replace(config, model=str(hub.fetch(config.model, config.revision)))


def _eos_ids(model_config: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = set(model_config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _runner(ctx: EngineContext, model, lora, tp, matchers, pipeline=None) -> ModelRunner:
    config = ctx.config
    backend = make_backend(config.attention_backend, ctx.device, config.block_size,
                           ctx.dtype, ctx.kv_format.dtype)
    check_layers_fit(backend.name, sinks=bool(ctx.model_config.attention_sinks),
                     latent=ctx.model_config.mla is not None)
    t0 = time.perf_counter()
    runner = ModelRunner(
        model, num_blocks=ctx.num_blocks, block_size=config.block_size, device=ctx.device,
        kv_format=ctx.kv_format, attn_backend=backend,
        drafter=make_drafter(ctx, model, backend),
        decode_graphs=_decode_graph_plan(ctx, backend, tp or pipeline), lora=lora,
        step_channel=tp.channel if tp is not None else None, matchers=matchers,
        layer_groups=ctx.layer_groups, pipeline=pipeline)
    if runner.decode_graphs is not None:
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s",
                 runner.decode_graphs.buckets, time.perf_counter() - t0)
    return runner


def _decode_graph_plan(ctx: EngineContext, backend, tp) -> DecodeGraphPlan | None:
    """CUDA graphs for decode-only steps, on CUDA unless --enforce-eager."""
    if ctx.device.type != "cuda" or ctx.config.enforce_eager or tp is not None:
        return None  # (tensor parallel steps stay eager until measured on GPUs)
    if not backend.graph_safe:
        log.info("CUDA graphs off: the %s attention backend cannot be captured",
                 backend.name)
        return None
    return DecodeGraphPlan(ctx.config.max_num_seqs, ctx.max_model_len)


def _start_compiling(ctx: EngineContext, runner: ModelRunner, tp) -> None:
    """The Inductor-compiled forward pass, as `compile` and --enforce-eager say
    (eager under tensor or pipeline parallelism, `tp`: the other ranks run eagerly)."""
    config = ctx.config
    mode = "off" if config.enforce_eager or tp is not None else config.compile
    if mode == "auto":
        mode = "off" if ctx.device.type == "cuda" else "background"
    if mode == "off":
        return
    if ctx.device.type == "cpu" and runner.attn_backend.name != "torch":
        # Triton's interpreter (a test vehicle on CPU) reads raw pointers that
        # Inductor's graphs do not promise it, and it is slower than any graph.
        log.info("forward pass not compiled: the %s attention backend runs in "
                 "Triton's interpreter on CPU", runner.attn_backend.name)
        return
    if c_compiler() is None:
        log.warning("no C++ compiler found (g++ or $CXX): the forward pass stays "
                    "eager, several times slower on CPU; install one (apt-get "
                    "install g++) or pass --enforce-eager to silence this")
        return
    use_cache_dir(str(cache_root()), config.compile_cache_bytes)
    packages = cache_root() / "graphs" if config.compile_cache != "off" else None
    # Packages missing from the cache are built by a process of their own
    # (package_build_process.py), the serving process's steps running meanwhile.
    build = functools.partial(build_in_child, config, packages) if packages else None
    runner.compile_forward(background=mode == "background", packages=packages,
                           build_packages=build)


def _grammar_gate(ctx: EngineContext, matchers: Matchers | None) -> GrammarGate | None:
    """Structured outputs, where there is a tokenizer to build grammars over (the
    runner's sampler masks with the same matchers)."""
    if matchers is None:
        return None
    config = ctx.config
    return GrammarGate(GrammarCompiler(
        ctx.tokenizer, ctx.model_config.vocab_size, list(ctx.eos_token_ids),
        config.structured_outputs_backend, config.grammar_compile_timeout,
        config.grammar_cache_bytes), matchers)


def _scheduler(ctx: EngineContext, kv_events: bool, tier=None) -> Scheduler:
    config, groups = ctx.config, ctx.layer_groups
    return Scheduler.with_kv_cache(
        SchedulerConfig(max_num_seqs=config.max_num_seqs,
                        max_num_batched_tokens=config.max_num_batched_tokens,
                        max_model_len=ctx.max_model_len, policy=config.scheduling_policy,
                        long_prefill_token_threshold=config.long_prefill_token_threshold,
                        background_prefill_tokens=config.background_prefill_tokens,
                        max_loras=config.lora.max_loras if config.lora is not None else 0,
                        steps_in_flight=config.pipeline_parallel_size),
        KVCacheConfig(num_blocks=ctx.num_blocks, block_size=config.block_size,
                      enable_prefix_caching=config.enable_prefix_caching,
                      model_key=str(config.model), kv_events=kv_events,
                      sliding_window=(groups.window if groups is not None
                                      else _droppable_window(config, ctx.model_config)),
                      window_groups=groups.window_groups if groups is not None else 0),
        tier)


def _cache_context(config: EngineConfig, model_config: ModelConfig, num_blocks: int,
                   groups: LayerGroups | None = None) -> int:
    """The longest request the cache can run: one wholly in it, or, where every
    layer has a window (its blocks let go of as it grows), any length once the
    window, a step's tokens and a block either side fit; a hybrid model's, what
    the full-attention group can hold beside every sliding group's window."""
    bs = config.block_size
    if groups is not None:
        reach = -(-(groups.window + config.max_num_batched_tokens) // bs) + 2
        windows = groups.window_groups * reach
        if num_blocks > windows + reach:
            return (num_blocks - windows) * bs
        if num_blocks <= groups.window_groups:
            raise ModelLoadError(f"a KV cache of {num_blocks} blocks holds no token of this "
                                 f"model's {1 + groups.window_groups} layer groups")
        return num_blocks // (1 + groups.window_groups) * bs
    capacity = num_blocks * config.block_size
    window = _droppable_window(config, model_config)
    if window and window + config.max_num_batched_tokens + 2 * config.block_size <= capacity:
        return model_config.max_model_len
    return capacity


def _droppable_window(config: EngineConfig, model_config: ModelConfig) -> int:
    """The window past which blocks are let go of: the model's, and a draft model's
    too where one reads the same block tables (0 where either sees everything)."""
    window = _every_layers_window(model_config)
    spec = config.speculative
    if window and spec is not None and spec.method == "draft":
        draft = _every_layers_window(ModelConfig.from_pretrained(spec.model))
        window = max(window, draft) if draft else 0
    return window


def _every_layers_window(cfg: ModelConfig) -> int:
    """The widest window where every layer has one (Mistral, Phi-3), else 0: a
    hybrid model's full layers (Gemma 2/3, gpt-oss) read every block."""
    windows = [cfg.window(layer) for layer in range(cfg.num_layers)]
    return max(windows) if all(windows) else 0
