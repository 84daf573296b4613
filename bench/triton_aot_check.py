"""Every Triton kernel of kvserve compiled for the GPUs it serves on, without a GPU:
sm_90 (H100/H200) and sm_80 (A100), in every variant the backends launch, with its
registers, spills and shared memory against the target's limits.

The launches are recorded, not written down: the public paths (the Triton attention
backend's forward over eager, CUDA-graph, prompt and mixed steps; the LoRA step's
BGMV op) run on small CPU tensors of the real dtypes and shapes, and every
`kernel[grid](...)` launch is caught before it runs. Triton's own binder then gives
what the GPU runtime would compile for it: argument types, constexprs, and its
specialisation of integers equal to 1 and of integers and pointers divisible by 16.
So a kernel whose signature changes needs no edit here. Where a wrapper decides by
the device it is told the GPU's answer: `upcast_on_load` -> False and `parallelism`
-> the target's SM count, replaced wherever engine modules imported them; the
store's inline INTERPRETED (k.device.type != "cuda") set to False in the recorded
launch; and the step's small int tensors packed per dtype as `upload` packs them on
CUDA.

A kernel variant (dtypes, constexprs, warps, stages) is launched in several runtime
specialisations, and each is a compile of its own on the GPU (the same variant
differs by tens of registers between them). Each distinct one is compiled once, in
worker processes (TRITON_INTERPRET=0, no cache read), its registers and spills read
from the ptxas log of that same compile; --one-per-variant compiles one each.

Covered: the presets (modelstore/presets) and the default model (SmolLM2-135M, 9/3
heads of 64), per tensor-parallel rank at 1/2/4/8 ranks; bf16, fp16, fp32; caches in
the model dtype and fp8 e4m3 (sm_90 only: engine/kernels/attention/selector.py refuses an fp8
cache below compute capability 8.9; none under tensor parallelism, which refuses LoRA
and CUDA graphs too); block sizes 16 (the default) and 32; LoRA max ranks 4-64 over 1
or 4 slots; windowed, soft-capped and sink layers (Gemma 2, gpt-oss); DeepSeek-V3's
latent attention (LATENT_SHAPE), absorbed and expanded; the routed
experts of Qwen3-30B-A3B, gpt-oss-20b and Mixtral-8x7B shapes (MOE_SHAPES), in the
model dtypes and quantized (MOE_QUANT).

  python bench/triton_aot_check.py --markdown out.md --json out.json
  python bench/triton_aot_check.py --targets 90 --block-sizes 16 --one-per-variant

Exit status 1 when a specialisation fails to compile or to fit, or when a @triton.jit
function under engine/ is neither launched nor called by a launched kernel."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from kvserve.benchmarks.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]

# Per SM on both architectures (CUDA occupancy tables); registers are allocated per
# warp in units of 256, and each block takes 1 KiB of shared memory for itself.
MAX_REGS_PER_THREAD = 255
REGS_PER_SM = 65536
REG_UNIT_PER_WARP = 256
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SHARED_RESERVED_PER_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class Target:
    arch: int  # compute capability, as GPUTarget takes it
    gpus: str
    sms: int  # what the wrappers' parallelism() answers there (decode split planning)
    max_shared: int  # bytes per block, opted in (Triton refuses a launch above)
    shared_per_sm: int
    # selector._check_triton refuses an fp8 cache below capability 8.9 (Triton has no
    # e4m3 there: "type fp8e4nv not supported in this architecture").
    fp8_cache: bool


# SM counts of the SXM parts (an H100 PCIe has 114): they only move split plans.
TARGETS = {90: Target(90, "H100/H200", 132, 227 * 1024, 228 * 1024, True),
           80: Target(80, "A100", 108, 163 * 1024, 164 * 1024, False)}

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn
TP_SIZES = (1, 2, 4, 8)
MAX_NUM_SEQS = 256  # CUDA-graph buckets up to bench/gpu_session.sh's --running 256
LORA_RANKS = (4, 8, 16, 32, 64)  # the tests' 4-16, the default 16, larger adapters
LORA_SLOTS = (1, 4)  # max_loras: 1 is the default
# Constexprs a wrapper computes inline from the device type: the GPU's value.
DEVICE_CONSTEXPRS = {"INTERPRETED": False}

# The default model's shape (/work/shared/notes/default-model.md; asserted by
# tests/modelstore/test_default_model.py): its config exists only once converted.
DEFAULT_MODEL = dict(name="smollm2-135m", hidden=576, intermediate=1536, layers=30,
                     heads=9, kv_heads=3, head_dim=64, max_len=8192, vocab=49152)


# ---------------------------------------------------------------------- model shapes
def model_configs() -> dict:
    """Name -> ModelConfig of every preset and of the default model."""
    from kvserve.engine.config.model_config import ModelConfig
    from kvserve.modelstore.presets import preset_names

    d = DEFAULT_MODEL
    configs = {d["name"]: ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=d["vocab"], hidden_size=d["hidden"],
        intermediate_size=d["intermediate"], num_layers=d["layers"], num_heads=d["heads"],
        num_kv_heads=d["kv_heads"], head_dim=d["head_dim"], rms_norm_eps=1e-5,
        max_position_embeddings=d["max_len"])}
    for name in preset_names():
        configs[name] = ModelConfig.from_pretrained(f"preset:{name}")
    return configs


def rank_config(cfg, tp: int):
    """cfg as one of `tp` ranks holds it (engine/models/tp_shard.py), or None where
    the model does not split so."""
    from kvserve.engine.models.tp_shard import TPShard
    from kvserve.modelstore.errors import ModelLoadError

    shard = TPShard(0, tp)
    try:
        shard.check(cfg)
    except ModelLoadError:
        return None
    return dataclasses.replace(cfg, num_heads=shard.heads(cfg),
                               num_kv_heads=shard.kv_heads(cfg),
                               intermediate_size=shard.intermediate(cfg))


# ---------------------------------------------------------------------- the steps
def eager_steps(max_len: int) -> Iterator[tuple[list[int], list[int]]]:
    """(starts, lens) of eager steps (decodes first): one decode at every context
    that changes the split plan's count (MIN_PARTITION 256 up to 64 splits) and at
    powers of two up to the model's limit; batches of decodes; prompt chunks from
    scratch and after a prefix-cache hit; mixed steps."""
    contexts = {1, 2, 17, 100, *range(256, 64 * 256 + 1, 256)}
    contexts |= {2 ** k for k in range(9, max_len.bit_length())}
    for ctx in sorted(c for c in contexts if c <= max_len):
        yield [ctx - 1], [1]
    for batch in (2, 5, 64, MAX_NUM_SEQS):
        for ctx in (1, 300, 5000, max_len):
            yield [min(ctx, max_len) - 1] * batch, [1] * batch
    for chunk in (2, 17, 64, 100, 512):
        for prefix in (0, 1000):
            yield [prefix], [chunk]
    yield [0, 0], [100, 17]
    yield [99, 0], [1, 64]
    yield [99, 4000, 0], [1, 1, 300]


def graph_max_lens(max_len: int) -> list[int]:
    """Context limits a CUDA graph is captured for: the model's own, and smaller ones
    (--max-model-len, or a KV cache too small for the model's)."""
    return sorted({m for m in (1000, 4096, max_len) if m <= max_len})


def eager_metadata(starts: list[int], lens: list[int], block_size: int):
    """The step's AttentionMetadata as the model runner builds it on CUDA."""
    from kvserve.engine.kernels.attention import step_metadata

    width = max(-(-(s + n) // block_size) for s, n in zip(starts, lens))
    host = step_metadata.build_host_step(starts, lens, np.zeros((len(lens), width), np.int64),
                                         block_size)
    # Packed per dtype as `upload` packs them on CUDA (Triton specialises pointers
    # on 16-byte alignment).
    packed = functools.partial(step_metadata.upload, pack=True)
    with mock.patch.object(step_metadata, "upload", packed):
        return host.to_device(torch.device("cpu"))[1]


def graph_metadata(batch: int, max_len: int, block_size: int):
    """A decode step inside a CUDA graph (engine/runner/cuda_graphs.py): the static buffers'
    first rows, tables as wide as max_len, no host lengths, planned for max_len."""
    from kvserve.engine.kernels.attention.context import AttentionMetadata

    width = -(-max_len // block_size)
    return AttentionMetadata(
        slot_mapping=torch.empty(batch, dtype=torch.int64),
        query_start_loc=torch.empty(batch + 1, dtype=torch.int32),
        seq_lens=torch.empty(batch, dtype=torch.int32),
        block_tables=torch.empty(batch, width, dtype=torch.int32),
        query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32), seq_lens_cpu=None,
        max_query_len=1, max_seq_len=max_len, num_decodes=batch, num_prefills=0,
        num_tokens=batch, block_size=block_size)


def qkv(cfg, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as engine/models/llama.py hands them over: q and k fresh from RoPE
    (contiguous), v a view of the packed qkv projection."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    packed = torch.empty(tokens, q_size + 2 * kv_size, dtype=dtype)
    v = packed[:, q_size + kv_size:].reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
    return (torch.empty(tokens, cfg.num_heads, cfg.head_dim, dtype=dtype),
            torch.empty(tokens, cfg.num_kv_heads, cfg.head_dim, dtype=dtype), v)


# What some families add to attention (engine/kernels/attention/score_mods.py): a
# Gemma 2 sliding layer (window and soft-cap) and a gpt-oss one (window and sinks).
SCORE_MODS = ({"window": 128, "softcap": 50.0}, {"window": 128, "sinks": True})


def run_attention(cfg, dtype: torch.dtype, fp8: bool, block_size: int, graphs: bool,
                  mods: dict | None = None) -> None:
    """Every step of eager_steps (and, with graphs, every CUDA-graph bucket) through
    the Triton backend over one layer's cache; mods: a layer's SCORE_MODS."""
    from kvserve.engine.kernels.attention.triton_backend import TritonBackend
    from kvserve.engine.runner.cuda_graphs import batch_buckets

    backend = TritonBackend()
    shape = (2, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [torch.empty(shape, dtype=FP8 if fp8 else dtype) for _ in range(2)]
    scales = [torch.ones((), dtype=torch.float32) for _ in range(2)] if fp8 else [None] * 2
    metas = [eager_metadata(s, n, block_size) for s, n in eager_steps(cfg.max_model_len)]
    if graphs:
        metas += [graph_metadata(b, m, block_size) for m in graph_max_lens(cfg.max_model_len)
                  for b in batch_buckets(MAX_NUM_SEQS)]
    mods = dict(mods or {})
    if mods.get("sinks"):
        mods["sinks"] = torch.zeros(cfg.num_heads, dtype=torch.float32)
    for meta in metas:
        q, k, v = qkv(cfg, meta.num_tokens, dtype)
        scale = cfg.head_dim ** -0.5
        backend.forward(q, k, v, *caches, backend.prepare(meta), scale, *scales, **mods)


# Latent attention (engine/models/mla.py) at DeepSeek-V3's widths: the cache's one
# head of latent + rotary (decodes and short chunks, absorbed:
# triton/latent_absorbed.py) and, for prompt chunks past the break-even length,
# heads of nope + rotary (triton/latent_expanded.py). The head count is no
# compile-time constant of either: 16 (DeepSeek-V2-Lite's, V3's per rank at 8 ranks)
# stands for every count.
LATENT_SHAPE = dict(heads=16, latent=512, rotary=64, nope=128, v=128)
LATENT_MAX_LEN = 163840


def run_latent(shape: dict, dtype: torch.dtype, block_size: int) -> None:
    """Every step of eager_steps and every CUDA-graph bucket through the Triton
    backend's latent attention over one layer's latent cache."""
    from kvserve.engine.kernels.attention.triton_backend import TritonBackend
    from kvserve.engine.runner.cuda_graphs import batch_buckets

    backend = TritonBackend()
    heads, latent, rotary, nope = (shape[k] for k in ("heads", "latent", "rotary", "nope"))
    cache = torch.empty(2, block_size, 1, latent + rotary, dtype=dtype)
    kv_b = torch.empty(heads * (nope + shape["v"]), latent, dtype=dtype)
    metas = [eager_metadata(s, n, block_size) for s, n in eager_steps(LATENT_MAX_LEN)]
    metas += [graph_metadata(b, m, block_size) for m in graph_max_lens(LATENT_MAX_LEN)
              for b in batch_buckets(MAX_NUM_SEQS)]
    for meta in metas:
        t = meta.num_tokens
        q = torch.empty(t, heads, latent + rotary, dtype=dtype)
        q_nope = torch.empty(t, heads, nope, dtype=dtype)
        entry = torch.empty(t, 1, latent + rotary, dtype=dtype)
        backend.latent_attention(q, q_nope, entry, cache, backend.prepare(meta),
                                 (nope + rotary) ** -0.5, kv_b, nope)


def run_lora(cfg, dtype: torch.dtype, slots: int, rank: int) -> None:
    """Each projection group's LoRA product through the BGMV kernels, as the model
    adds it, over the LoRA manager's own stacked buffers (one layer of them)."""
    from kvserve.engine.platform.host_copy import to_device
    from kvserve.engine.lora.adapter import projection_shapes
    from kvserve.engine.config.lora_config import LoRAConfig
    from kvserve.engine.lora.manager import LoRAManager
    from kvserve.engine.models.lora_step import GROUPS

    one_layer = dataclasses.replace(cfg, num_layers=1)
    manager = LoRAManager(LoRAConfig(True, (), slots, rank), one_layer, torch.device("cpu"),
                          dtype, kernels="triton")
    shapes = projection_shapes(one_layer)
    for tokens in (1, 300):
        step = manager.inputs(to_device([0] * tokens, torch.int32, torch.device("cpu")))
        for group, projections in GROUPS.items():
            if not any(shapes[p][1] for p in projections):
                continue  # another family's projections (latent attention's)
            x = torch.empty(tokens, shapes[projections[0]][0], dtype=dtype)
            y = torch.empty(tokens, sum(shapes[p][1] for p in projections), dtype=dtype)
            step.add(group, 0, x, y)


# Mixture-of-experts layers shaped as their families' models are, per rank (expert
# parallelism holds whole experts, so a rank's expert has the model's shape):
# hidden, expert intermediate, top-k, gpt-oss's biases and clamped SwiGLU.
MOE_SHAPES = {"qwen3-30b-a3b": (2048, 768, 8, False), "gpt-oss-20b": (2880, 2880, 4, True),
              "mixtral-8x7b": (4096, 14336, 2, False)}


# Quantized experts the kernels widen as they load (triton_experts._weight_tile):
# int8 rows (--quantization int8), int8 groups of 32 (a GGUF's Q8_0), 4-bit code pairs
# with minimums in groups of 32 (a GGUF's K-quants, --quantization int4).
MOE_QUANT = ("int8-rows", "int8-groups", "int4-groups")


def _experts(shape: tuple[int, int, int], dtype: torch.dtype, quant: str | None):
    """(weights, (scale, minimum)) of experts of `shape` stored as `quant` says."""
    e, n, k = shape
    if quant is None:
        return torch.empty(shape, dtype=dtype), (None, None)
    if quant == "int8-rows":
        return torch.empty(shape, dtype=torch.int8), (torch.empty(e, n), None)
    groups = torch.empty(e, n, k // 32)
    if quant == "int8-groups":
        return torch.empty(shape, dtype=torch.int8), (groups, None)
    return torch.empty(e, n, k // 2, dtype=torch.uint8), (groups, torch.empty(e, n, k // 32))


def run_moe(hidden: int, inter: int, top_k: int, oai: bool, dtype: torch.dtype,
            quant: str | None = None) -> None:
    """The routed experts' Triton GEMMs at decode and prompt sizes, their weights as
    stored by `quant` (MOE_QUANT; None: in `dtype`). Two experts are allocated (never
    filled): the kernels' strides are those of any count."""
    from kvserve.engine.kernels.moe.triton_experts import triton_fused_experts

    experts = 2
    w13, q13 = _experts((experts, 2 * inter, hidden), dtype, quant)
    w2, q2 = _experts((experts, hidden, inter), dtype, quant)
    biases = ((torch.empty(experts, 2 * inter, dtype=dtype),
               torch.empty(experts, hidden, dtype=dtype)) if oai else (None, None))
    activation = ("swiglu_oai", 7.0, 1.702) if oai else ("silu", 0.0, 0.0)
    for tokens in (1, 64, 512):
        x = torch.empty(tokens, hidden, dtype=dtype)
        ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
        weights = torch.empty(tokens, top_k, dtype=dtype)
        triton_fused_experts(x, ids, weights, w13, w2, 0, *biases, *activation, q13, q2)


def configurations(target: Target, block_sizes: tuple[int, ...],
                   dtypes: tuple[torch.dtype, ...] = DTYPES
                   ) -> Iterator[tuple[str, object]]:
    """(label, a function running it) for every configuration the target serves in
    `dtypes` (quantized experts' activations: bf16, whatever `dtypes`)."""
    for dtype in dtypes:
        for bs in block_sizes:
            yield (f"deepseek-v3 latent {str(dtype).removeprefix('torch.')} bs{bs}",
                   lambda d=dtype, b=bs: run_latent(LATENT_SHAPE, d, b))
    for name, shape in MOE_SHAPES.items():
        for dtype in dtypes:
            yield (f"{name} experts {str(dtype).removeprefix('torch.')}",
                   lambda s=shape, d=dtype: run_moe(*s, d))
        for quant in MOE_QUANT:  # activations in bf16, as served
            yield (f"{name} experts bfloat16 {quant}",
                   lambda s=shape, q=quant: run_moe(*s, torch.bfloat16, q))
    for name, cfg in model_configs().items():
        for tp in TP_SIZES:
            rank = rank_config(cfg, tp)
            if rank is None:
                continue
            for dtype in dtypes:
                dt = str(dtype).removeprefix("torch.")
                caches = (False, True) if tp == 1 and target.fp8_cache else (False,)
                for fp8, bs in ((f, b) for f in caches for b in block_sizes):
                    label = f"{name} tp{tp} {dt} kv:{'fp8' if fp8 else dt} bs{bs}"
                    # Tensor-parallel steps stay eager (Engine._decode_graph_plan).
                    yield label, lambda r=rank, d=dtype, f=fp8, b=bs, g=tp == 1: \
                        run_attention(r, d, f, b, g)
                    if tp == 1 and not fp8 and dtype != torch.float16:
                        for mods in SCORE_MODS:
                            yield (f"{label} {'+'.join(mods)}",
                                   lambda r=rank, d=dtype, b=bs, m=mods:
                                   run_attention(r, d, False, b, True, m))
                if tp == 1:
                    for slots, rank_ in ((s, r) for s in LORA_SLOTS for r in LORA_RANKS):
                        yield (f"{name} {dt} lora r{rank_} x{slots}",
                               lambda c=cfg, d=dtype, s=slots, r=rank_: run_lora(c, d, s, r))


# ---------------------------------------------------------------------- recording
@dataclasses.dataclass
class Specialisation:
    """One kernel for one target as JITFunction.run would compile it for a launch:
    its variant (dtypes, constexprs, options) and the runtime's specialisation of
    integer and pointer arguments; `uses`: the configurations that launch it."""
    module: str
    name: str
    arch: int
    signature: dict
    constexprs: dict  # {(arg index,): value}, declared and runtime-specialised
    attrs: dict  # {(arg index,): [["tt.divisibility", 16]]}
    options: dict
    declared: tuple[str, ...]  # the tl.constexpr parameters
    uses: set = dataclasses.field(default_factory=set)

    def key(self) -> str:
        return repr((self.module, self.name, self.arch, sorted(self.signature.items()),
                     sorted(self.constexprs.items()), sorted(self.attrs.items()),
                     sorted(self.options.items())))

    def variant(self) -> str:
        """The kernel variant: what the launch states (argument dtypes, declared
        constexprs, warps, stages), not the runtime's specialisation."""
        return repr((self.arch, self.module, self.name, self.pointers(),
                     sorted(self.declared_values().items()), self.options["num_warps"],
                     self.options["num_stages"]))

    def pointers(self) -> dict:
        return {n: t for n, t in self.signature.items() if t.startswith("*")}

    def declared_values(self) -> dict:
        names = list(self.signature)
        return {names[i]: value for (i,), value in self.constexprs.items()
                if names[i] in self.declared}

    def runtime(self) -> dict:
        """The runtime's specialisation: arguments equal to 1, and those integers and
        pointers it could not prove 16-aligned."""
        names = list(self.signature)
        ones = [names[i] for (i,), v in self.constexprs.items()
                if names[i] not in self.declared and v == 1]
        unaligned = [names[i] for (i,), a in self.attrs.items()
                     if not a and self.signature[names[i]] != "constexpr"]
        return {"equal_to_1": sorted(ones), "not_16_aligned": sorted(unaligned)}


class Recorder:
    """Catches kernel launches (compiled or interpreted kernels alike) and keeps the
    specialisation the CUDA backend's binder gives each."""

    def __init__(self, target: Target):
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        self.target = target
        self.backend = make_backend(GPUTarget("cuda", target.arch, 32))
        self.found: dict[str, Specialisation] = {}
        self.label = ""
        self._jit: dict = {}
        self._seen: dict = {}

    def launch(self, kernel, args: tuple, kwargs: dict) -> None:
        jit, binder = self._jit_of(kernel)
        bound, specialization, options = binder(*args, **kwargs)
        # JITFunction.run's cache key: a launch seen before needs no unpacking.
        key = (jit.fn, repr(specialization), repr(sorted(options.items())))
        seen = self._seen.get(key)
        if seen is not None:
            seen.uses.add(self.label)
            return
        options, signature, constexprs, attrs = jit._pack_args(
            self.backend, kwargs, bound, specialization, options)
        for param in jit.params:
            if param.name in DEVICE_CONSTEXPRS and param.is_constexpr:
                constexprs[(param.num,)] = DEVICE_CONSTEXPRS[param.name]
        spec = Specialisation(jit.fn.__module__, jit.fn.__name__, self.target.arch,
                              signature, constexprs, attrs, dict(options.__dict__),
                              tuple(p.name for p in jit.params if p.is_constexpr))
        spec = self.found.setdefault(spec.key(), spec)
        spec.uses.add(self.label)
        self._seen[key] = spec

    def _jit_of(self, kernel):
        """The kernel's JITFunction (an interpreted kernel has none: made here) and
        its binder for the CUDA backend, once per kernel."""
        from triton.runtime.jit import JITFunction, create_function_from_signature

        if kernel.fn not in self._jit:
            # An interpreted kernel keeps its decorator's options: the same binder.
            options = {k: v for k, v in getattr(kernel, "kwargs", {}).items()
                       if k.startswith("do_not_specialize")}
            jit = (kernel if isinstance(kernel, JITFunction)
                   else JITFunction(kernel.fn, **options))
            self._jit[kernel.fn] = jit, create_function_from_signature(
                jit.signature, jit.params, self.backend)
        return self._jit[kernel.fn]

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Launches recorded instead of run; the wrappers told the target's facts."""
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        from kvserve.engine.kernels.attention.triton import common

        def run(kernel, *args, grid, warmup, **kwargs):
            self.launch(kernel, args, kwargs)

        with contextlib.ExitStack() as stack:
            for cls in (JITFunction, InterpretedFunction):
                stack.enter_context(mock.patch.object(cls, "run", run))
            stack.enter_context(replaced(common.upcast_on_load, lambda t: False))
            stack.enter_context(replaced(common.parallelism, lambda device: self.target.sms))
            yield


@contextlib.contextmanager
def replaced(func, replacement) -> Iterator[None]:
    """func replaced in every loaded engine module that holds it (the wrappers
    import their helpers by name)."""
    with contextlib.ExitStack() as stack:
        for module in [m for n, m in list(sys.modules.items()) if n.startswith("kvserve.engine.")]:
            for attr, value in list(vars(module).items()):
                if value is func:
                    stack.enter_context(mock.patch.object(module, attr, replacement))
        yield


def record(target: Target, block_sizes: tuple[int, ...], only: str | None = None,
           dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[Specialisation]:
    """Every specialisation the target's configurations (those whose label holds
    `only`, if given) launch."""
    import kvserve.engine.kernels.attention.triton_backend  # noqa: F401  (the helpers to replace)
    import kvserve.engine.kernels.lora.triton_kernels  # noqa: F401

    recorder = Recorder(target)
    with recorder.recording(), torch.inference_mode():
        for label, run in configurations(target, block_sizes, dtypes):
            if only is not None and only not in label:
                continue
            recorder.label = label
            run()
    return list(recorder.found.values())


# ---------------------------------------------------------------------- coverage
def jit_functions() -> set[str]:
    """module.name of every @triton.jit function under engine/ (the modules whose
    source mentions it are imported)."""
    from triton.runtime.jit import KernelInterface

    found = set()
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if "triton.jit" not in path.read_text():
            continue
        name = ".".join(["kvserve", *path.relative_to(ROOT).with_suffix("").parts])
        module = importlib.import_module(name)
        found |= {f"{name}.{attr}" for attr, value in vars(module).items()
                  if isinstance(value, KernelInterface) and value.fn.__module__ == name}
    return found


def called(module: str, name: str, seen: set[str]) -> set[str]:
    """The jit function module.name and every jit function it calls, transitively
    (the globals its code names)."""
    from triton.runtime.jit import KernelInterface

    full = f"{module}.{name}"
    if full in seen:
        return seen
    seen.add(full)
    fn = getattr(importlib.import_module(module), name).fn
    for global_name in fn.__code__.co_names:
        value = fn.__globals__.get(global_name)
        if isinstance(value, KernelInterface):
            called(value.fn.__module__, value.fn.__name__, seen)
    return seen


def uncovered(launched: list) -> list[str]:
    """@triton.jit functions under engine/ that no launched kernel (.module, .name)
    is or calls."""
    reached: set[str] = set()
    for s in launched:
        called(s.module, s.name, reached)
    return sorted(jit_functions() - reached)


# ---------------------------------------------------------------------- compiling
PTXAS_REGS = re.compile(r"Used (\d+) registers")
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads")
CRASHED = "the compiler killed its process (its message is on stderr)"
PROGRAM_ID = re.compile(r"%(\S+) = tt.get_program_id ([xyz]) : i32")


def wide_program_ids(ttir: str) -> list[str]:
    """The grid axes whose program id the kernel widens to int64 at once (its
    offsets then cannot wrap at 2**31 elements), from its Triton IR."""
    return sorted(axis for name, axis in PROGRAM_ID.findall(ttir)
                  if f"arith.extsi %{name} : i32 to i64" in ttir)


def _worker_init() -> None:
    """Compile workers: kernels imported as JITFunctions, every variant compiled
    afresh (no cache read), and ptxas's -v log printed, to read the registers of
    that very compile."""
    os.environ.update(TRITON_INTERPRET="0", TRITON_ALWAYS_COMPILE="1",
                      TRITON_DUMP_PTXAS_LOG="1")


def compile_one(s: Specialisation) -> dict:
    """triton.compile for its target: registers, spills, stack and shared memory,
    or the error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    fn = getattr(importlib.import_module(s.module), s.name)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, s.signature, s.constexprs, s.attrs),
                                    target=GPUTarget("cuda", s.arch, 32), options=s.options)
    except Exception as exc:  # a failed compile is a finding, not a crash
        lines = [line for line in str(exc).splitlines() if line.strip()] or [""]
        # Triton's CompilationError ends with the cause, ptxas's error starts with it.
        said = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
        return {"error": f"{type(exc).__name__}: {said[:400]}"}
    seconds = time.perf_counter() - start
    regs, frame = PTXAS_REGS.search(log.getvalue()), PTXAS_FRAME.search(log.getvalue())
    if regs is None or frame is None:
        return {"error": "no ptxas -v log in the compile's output"}
    return {"registers": int(regs[1]), "stack_bytes": int(frame[1]),
            "spill_stores": int(frame[2]), "spill_loads": int(frame[3]),
            "shared_bytes": kernel.metadata.shared, "compile_s": round(seconds, 2),
            "wide_program_ids": wide_program_ids(kernel.asm["ttir"])}


def compile_all(specs: list[Specialisation], jobs: int) -> list[dict]:
    """compile_one of each, in `jobs` fresh processes (the recording process may
    have imported its kernels for Triton's interpreter). A compile can kill its
    process (LLVM aborts on what it cannot lower) and the pool's other compiles with
    it: those run again, and when a round finishes none, its first ones alone."""
    results: dict[str, dict] = {}
    pending = list(specs)
    while pending:
        done = _pool_run(pending, jobs)
        if not done:
            for s in pending[:jobs]:
                done |= _pool_run([s], 1) or {s.key(): {"error": CRASHED}}
        results |= done
        pending = [s for s in pending if s.key() not in results]
    return [results[s.key()] for s in specs]


def _pool_run(specs: list[Specialisation], jobs: int) -> dict[str, dict]:
    """{key: compile_one's result} of those done before the pool broke, if it did."""
    done: dict[str, dict] = {}
    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=_worker_init) as pool:
            futures = {pool.submit(compile_one, s): s.key() for s in specs}
            for future in as_completed(futures):
                done[futures[future]] = future.result()
    except BrokenProcessPool:
        pass
    return done


# ---------------------------------------------------------------------- limits
def blocks_per_sm(c: dict, warps: int, target: Target) -> tuple[int, str]:
    """Resident blocks per SM and what limits them."""
    per_warp = -(-c["registers"] * 32 // REG_UNIT_PER_WARP) * REG_UNIT_PER_WARP
    shared = c["shared_bytes"] + SHARED_RESERVED_PER_BLOCK
    limits = {"registers": REGS_PER_SM // per_warp // warps,
              "shared": target.shared_per_sm // shared,
              "warps": MAX_WARPS_PER_SM // warps, "blocks": MAX_BLOCKS_PER_SM}
    what = min(limits, key=limits.get)
    return limits[what], what


def problems(c: dict, target: Target) -> list[str]:
    """Why the specialisation cannot run, or not well, on the target; [] if it fits."""
    if "error" in c:
        return [f"does not compile: {c['error']}"]
    found = []
    if c["registers"] > MAX_REGS_PER_THREAD:
        found.append(f"{c['registers']} registers > {MAX_REGS_PER_THREAD}")
    if c["spill_stores"] or c["spill_loads"]:
        found.append(f"spills: {c['spill_stores']} B stored, {c['spill_loads']} B loaded")
    if c["shared_bytes"] > target.max_shared:
        found.append(f"{c['shared_bytes']} B shared > {target.max_shared}")
    if c["blocks_per_sm"] < 1:
        found.append(f"no block fits an SM ({c['occupancy_limit']})")
    return found


def compiled_entry(s: Specialisation, c: dict) -> dict:
    """The report's record of one compiled specialisation."""
    target = TARGETS[s.arch]
    if "error" not in c:
        c["blocks_per_sm"], c["occupancy_limit"] = blocks_per_sm(c, s.options["num_warps"],
                                                                 target)
    return {**s.runtime(), **c, "problems": problems(c, target), "configurations": len(s.uses)}


def variants(specs: list[Specialisation], compiled: dict[str, dict]) -> list[dict]:
    """The report's kernel variants: what the launches state, every configuration
    launching one, and its compiled specialisations."""
    found: dict[str, dict] = {}
    for s in specs:
        v = found.setdefault(s.variant(), {
            "target": f"sm_{s.arch}", "kernel": s.name, "module": s.module,
            "pointers": s.pointers(), "constexprs": s.declared_values(),
            "num_warps": s.options["num_warps"], "num_stages": s.options["num_stages"],
            "recorded": 0, "uses": set(), "specialisations": []})
        v["recorded"] += 1
        v["uses"] |= s.uses
        if s.key() in compiled:
            v["specialisations"].append(compiled_entry(s, compiled[s.key()]))
    for v in found.values():
        v["uses"] = sorted(v["uses"])
    return sorted(found.values(), key=lambda v: (v["target"], v["kernel"],
                                                 json.dumps(v["pointers"]),
                                                 json.dumps(v["constexprs"])))


def to_compile(specs: list[Specialisation], every: bool) -> list[Specialisation]:
    """Every recorded specialisation, or one per kernel variant: the most general
    (fewest arguments equal to 1: the code long contexts and big batches run), the
    most used among those. One is a sample: a variant's specialisations differ (on
    sm_90, bf16 prefill at head_dim 128: 186 or 214 registers)."""
    if every:
        return specs
    chosen: dict[str, Specialisation] = {}
    for s in specs:
        rank = (-len(s.runtime()["equal_to_1"]), len(s.uses))
        best = chosen.get(s.variant())
        if best is None or rank > (-len(best.runtime()["equal_to_1"]), len(best.uses)):
            chosen[s.variant()] = s
    return list(chosen.values())


# ---------------------------------------------------------------------- report
def markdown(found: list[dict], meta: dict) -> str:
    """The report: where it comes from, a row per kernel and target, a row per
    kernel variant."""
    return "\n".join(_header(found, meta) + _per_kernel(found) + _per_variant(found)) + "\n"


def _header(found: list[dict], meta: dict) -> list[str]:
    compiled = [s for v in found for s in v["specialisations"]]
    tree = "modified: " + ", ".join(meta["modified"]) if meta["modified"] else "clean"
    return [f"# Triton kernels compiled ahead of time: {', '.join(meta['targets'])}", "",
            f"kvserve at commit {meta['commit']} (engine/ {tree}), triton {meta['triton']} "
            f"(its ptxas {meta['ptxas']}), on {meta['device']}, {meta['date']}; "
            f"{meta['total_s']} s with {meta['jobs']} compile processes.", "",
            "Command:", "", f"    {meta['command']}", "",
            f"{len(found)} kernel variants (dtypes, constexprs, warps, stages) over "
            f"{meta['configurations']} configurations; {meta['recorded']} runtime "
            f"specialisations recorded, {len(compiled)} compiled, "
            f"{sum(bool(s['problems']) for s in compiled)} with problems. @triton.jit "
            f"functions under engine/ not covered: {', '.join(meta['uncovered']) or 'none'}.",
            "", "Fits: at most 255 registers, no spills, shared memory within the block "
            "limit (227 KiB on sm_90, 163 KiB on sm_80) and at least one block per SM "
            "(65536 registers, 228 / 164 KiB of shared memory)."]


def _per_kernel(found: list[dict]) -> list[str]:
    lines = ["", "## Per kernel", "",
             "| target | kernel | variants | specialisations | registers "
             "| max spills st/ld (B) | shared (B) | min blocks/SM | variants with problems |",
             "|" + "---|" * 9]
    for (target, kernel), rows in _by_kernel(found).items():
        specs = [s for v in rows for s in v["specialisations"] if "error" not in s]
        cells = [target, kernel, len(rows), sum(len(v["specialisations"]) for v in rows),
                 _span(s["registers"] for s in specs),
                 f"{max((s['spill_stores'] for s in specs), default=0)}/"
                 f"{max((s['spill_loads'] for s in specs), default=0)}",
                 _span(s["shared_bytes"] for s in specs),
                 min((s["blocks_per_sm"] for s in specs), default="-"),
                 sum(any(s["problems"] for s in v["specialisations"]) for v in rows)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def _per_variant(found: list[dict]) -> list[str]:
    return ["", "## Every variant", "",
            "Pointers: the arguments' element types; constexprs: the declared ones. "
            "Specialisations: compiled / recorded (the runtime's integers equal to 1 and "
            "16-byte alignment of integers and pointers); the ranges are over the compiled "
            "ones. Blocks/SM: resident blocks per SM, the fewest, and what limits them. "
            "Used by: model (per tensor-parallel rank), dtype, KV cache, block size; or "
            "model, dtype, LoRA max rank x slots.", "",
            "| target | kernel | pointers | constexprs | warps/stages | specialisations "
            "| registers | spills st/ld (B) | stack (B) | shared (B) | blocks/SM | problems "
            "| used by |", "|" + "---|" * 13] + \
        ["| " + " | ".join(_cells(v)) + " |" for v in found]


def describe(v: dict) -> str:
    """A kernel variant in one line: target, kernel, pointer types, constexprs."""
    return " ".join([v["target"], v["kernel"], _pointers(v), _constexprs(v)])


def _pointers(v: dict) -> str:
    return " ".join(f"{n.removesuffix('_ptr')}:{t[1:]}" for n, t in v["pointers"].items())


def _constexprs(v: dict) -> str:
    return " ".join(f"{n}={value}" for n, value in v["constexprs"].items())


def _cells(v: dict) -> list[str]:
    specs = [s for s in v["specialisations"] if "error" not in s]
    worst = min(specs, key=lambda s: s["blocks_per_sm"], default=None)
    found = sorted({p for s in v["specialisations"] for p in s["problems"]})
    return [v["target"], v["kernel"], _pointers(v), _constexprs(v),
            f"{v['num_warps']}/{v['num_stages']}",
            f"{len(v['specialisations'])}/{v['recorded']}",
            _span(s["registers"] for s in specs),
            _span(s["spill_stores"] for s in specs) + "/"
            + _span(s["spill_loads"] for s in specs),
            _span(s["stack_bytes"] for s in specs), _span(s["shared_bytes"] for s in specs),
            f"{worst['blocks_per_sm']} ({worst['occupancy_limit']})" if worst else "-",
            "; ".join(found) or "fits", _uses(v["uses"])]


def _uses(uses: list[str]) -> str:
    return "; ".join(uses[:2]) + (f" (+{len(uses) - 2})" if len(uses) > 2 else "")


def _span(values) -> str:
    values = list(values)
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _by_kernel(found: list[dict]) -> dict:
    by: dict = {}
    for v in found:
        by.setdefault((v["target"], v["kernel"]), []).append(v)
    return by


def ptxas_version() -> str:
    from triton import knobs

    out = subprocess.run([knobs.nvidia.ptxas.path, "--version"], capture_output=True,
                         text=True).stdout
    found = re.search(r"release (\S+?),", out)
    return found[1] if found else "unknown"


def modified_kernels() -> list[str]:
    """Files under engine/ that differ from the commit (a tree being edited)."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "engine"], cwd=ROOT,
                         capture_output=True, text=True).stdout
    return [line[3:] for line in out.splitlines()]


def check(targets: list[int], block_sizes: tuple[int, ...], every: bool,
          jobs: int, only: str | None = None, dtypes: tuple[torch.dtype, ...] = DTYPES
          ) -> tuple[list[dict], dict]:
    """(kernel variants, facts): every target's launches recorded, then compiled;
    with `only`, the configurations whose label holds it (coverage not checked)."""
    import triton

    started, modified = time.perf_counter(), modified_kernels()
    specs = [s for arch in targets for s in record(TARGETS[arch], block_sizes, only, dtypes)]
    recorded = time.perf_counter() - started
    chosen = to_compile(specs, every)
    compiled = dict(zip((s.key() for s in chosen), compile_all(chosen, jobs)))
    meta = {**provenance(), "targets": [f"sm_{a} ({TARGETS[a].gpus})" for a in targets],
            "modified": modified, "triton": triton.__version__,
            "ptxas": ptxas_version(), "date": time.strftime("%Y-%m-%d"), "jobs": jobs,
            "block_sizes": block_sizes, "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "every_specialisation": every,
            "recorded": len(specs), "configurations": len({u for s in specs for u in s.uses}),
            "uncovered": uncovered(specs) if only is None else [], "only": only,
            "record_s": round(recorded, 1),
            "total_s": round(time.perf_counter() - started, 1)}
    return variants(specs, compiled), meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="90,80",
                        help="compute capabilities, comma-separated (of 90, 80)")
    parser.add_argument("--block-sizes", default="16,32", help="KV-cache block sizes")
    parser.add_argument("--one-per-variant", action="store_true",
                        help="compile one runtime specialisation per kernel variant (the "
                        "most general) instead of every one recorded")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="compile processes")
    parser.add_argument("--json", type=Path, help="write every specialisation here")
    parser.add_argument("--markdown", type=Path,
                        help="write the tables here (else print them all)")
    parser.add_argument("--only", help="check only the configurations whose label holds "
                        "this (e.g. 'latent'); coverage is then not checked")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32",
                        help="model dtypes, comma-separated (of bfloat16, float16, float32)")
    args = parser.parse_args(argv)
    names = {str(d).removeprefix("torch."): d for d in DTYPES}
    if unknown_dtypes := [d for d in args.dtypes.split(",") if d not in names]:
        parser.error(f"unknown dtypes {unknown_dtypes}; known: {list(names)}")
    dtypes = tuple(names[d] for d in args.dtypes.split(","))
    targets = [int(t) for t in args.targets.split(",")]
    if unknown := [t for t in targets if t not in TARGETS]:
        parser.error(f"unknown targets {unknown}; known: {sorted(TARGETS)}")
    block_sizes = tuple(int(b) for b in args.block_sizes.split(","))
    found, meta = check(targets, block_sizes, not args.one_per_variant, args.jobs,
                        args.only, dtypes)
    if args.json:
        # One line per variant: a new run's diff shows the variants that changed.
        args.json.write_text("{\"meta\": " + json.dumps(meta) + ",\n\"variants\": [\n"
                             + ",\n".join(json.dumps(v) for v in found) + "]}\n")
    text = markdown(found, meta)
    if args.markdown:
        args.markdown.write_text(text)
    print(text if args.markdown is None else text.split("\n## Every variant")[0])
    for v in found:
        for s in v["specialisations"]:
            if s["problems"]:
                print(f"PROBLEM {describe(v)} (=1: {s['equal_to_1']}, not 16-aligned: "
                      f"{s['not_16_aligned']}): {'; '.join(s['problems'])}")
    print(f"recorded in {meta['record_s']} s, {meta['total_s']} s in all")
    failed = any(s["problems"] for v in found for s in v["specialisations"])
    return 1 if meta["uncovered"] or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
