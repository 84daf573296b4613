"""The decoder's forward pass compiled by Inductor (torch.compile), with eager steps
until the compiled graphs are ready.

Why: eager PyTorch pays Python and dispatch for every one of ~30 layers x ~20 ops,
and on CPU its matmuls read the weights at a third of the memory bandwidth at batch 1
(bench/in_process/profile.py measures both). Inductor fuses the elementwise ops,
freezes the weights (prepacked for oneDNN), and at batch 1 generates its own GEMV
kernels (the CPP GEMM template) that read them near the bandwidth. Linear layers
packed for kvserve's CPU GEMM (engine/kernels/cpu) stay calls of its op in every graph.

Three graphs, so no workload recompiles once they exist:
- decode, one request: logits of one token (static shape but for the context's
  length; the CPP GEMM template); on CPU called directly, past Dynamo's frame, once
  built (engine/runner/direct_graph.py: 0.9-1.4 ms of a ~15 ms default-model step);
- decode, 2+ requests: logits of every row, the row count dynamic;
- hidden: the final hidden states of a mixed step of 2+ tokens, dynamic; the runner
  takes the logits of the rows it needs.
Mixed steps are compiled piecewise: attention is the custom op
`kvserve::paged_attention`, and the step's metadata stays outside the graph. Decode
steps on CPU take their attention inputs (block tables, lengths, slots: a
`PagedDecode`) as graph inputs instead, and the attention is traced in with the rest
(engine/kernels/attention/cpu_paged.py): with no CUDA graph to hide them, 30 exits to a
custom op made a bf16 batch-1 step 14.8 ms instead of 10.6. Elsewhere decode graphs
call the custom op too.
Where a linear layer multiplies through torch (oneDNN), the graphs freeze the weights:
constants, prepacked for oneDNN; without that a decode step is 1.2-2x slower
(measured: batch 1 22.2 vs 10.6 ms, batch 32 54 vs 44 ms, bf16). But Inductor's graph
cache refuses frozen graphs, so tracing and lowering are redone on every start:
compiling the default model's three graphs took 140 s on two cores with a cold cache
and 17 s with a warm one (AVX-512), 285-314 s either way on a 2-core AVX2 CPU, and
each graph holds a copy of the weights. Where every linear layer is packed for
kvserve's CPU GEMM (engine/kernels/cpu: float32 on AVX2 CPUs, bf16 on AVX512-BF16
ones, in the pair layout oneDNN prepacks into), there is nothing to prepack and the
weights stay graph inputs: the graphs then come from
$KVSERVE_CACHE/inductor/<ops key> on a warm start (the default model's three: 174 s with an
empty cache, 35 s warm, on a 2-core AVX2 CPU; decode steps as fast as frozen ones).
Either way the graphs are built on a thread of their own by default while steps run
eagerly.
With --compile-cache packages (CPU, no LoRA, a (K, V) pair per layer) the three
graphs are AOTInductor packages instead (packaged_forward.py): built once by a
process of their own, kept on disk under a key, and loaded in about a second at
every later start."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import types
from collections.abc import Callable

import torch
import torch._inductor.config

from kvserve.engine.kernels.attention.cpu_paged import PagedDecode
from kvserve.engine.models.decoder import DecoderModel
from kvserve.engine.models.lora_step import LoRAStep
from kvserve.engine.models.quantized.layer import QuantizedLinear
from kvserve.engine.runner.compile_process import track_build, trim_cache
from kvserve.engine.runner.direct_graph import DirectCall, GraphRecorder, model_tensors
from kvserve.engine.runner.dynamic_marks import (dynamic, dynamic_groups, dynamic_lora,
                                                 dynamic_paged, marking)
from kvserve.engine.runner.packaged_forward import PackagedForward, Plan

log = logging.getLogger("kvserve.compile")

# Batch-1 decode reads each weight once for one row: Inductor's own GEMV kernels
# beat oneDNN's there (and only there: they lose from ~8 rows on). They are the only
# choice: autotuning between the two (each timed alone, its weight hot in cache)
# picked oneDNN for some GEMMs, Inductor keeps the pick on disk for every later
# start, and workload a of bench/compare_cpu.py ran at 62-72 tok/s instead of 76-95.
# Where the template covers no choice for a GEMM (some float32 shapes), the graph is
# built again with oneDNN allowed.
# CPU only: on CUDA the CPP template has no kernel for any GEMM (every batch-1 graph
# would fail once and be built again), and cuBLAS through Inductor's defaults is
# what a decode step replays in its CUDA graph.
BATCH_ONE = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}
BATCH_ONE_FALLBACK = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def _unguarded_model(entries) -> list[bool]:
    """Dynamo's guards minus those on `self` (the model, its weights, its KV caches):
    they never change once the graphs are built, and each CompiledModel compiles
    code objects of its own (`_own_code`), so no other model can reach its graphs.
    Checking ~30 guards a layer cost 0.45 ms of a 11 ms bf16 batch-1 step."""
    return [not (e.name == "self" or e.name.startswith("self.")) for e in entries]


# The model's tensors unchecked at each call: no Dynamo guards on them (above), and
# none of Inductor's size / stride / alignment asserts either, for the same reason
# (the step's own inputs keep Dynamo's guards). ~520 asserts of ~1.3 us each were
# ~0.6 ms of a ~13 ms batch-1 int8 step of the default model (measured in separate
# processes, alternating: 0.4 ms median of 5 pairs, 4 of them faster).
MODEL_UNCHECKED = {"guard_filter_fn": _unguarded_model, "size_asserts": False,
                   "alignment_asserts": False}

# On CPU, where no CUDA graph replays a step, each graph's wrapper (the code that
# allocates its buffers and calls its kernels and kvserve's ops, ~250 calls a decode
# step of the default model) is C++ rather than Python: ~1-1.5 ms less a step of the
# default model's 30 layers (bench/results/cpu_wrapper_*.md). Wrapper and kernels
# built as separate libraries: one translation unit of both took twice as long to
# compile cold (a 30-layer graph: 535 s against 268, 215 with the Python wrapper).
CPP_WRAPPER = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def torch_gemms(model: torch.nn.Module) -> bool:
    """Whether any linear layer of `model` multiplies through torch's kernels (oneDNN
    for float weights, torch's int8 / int4 ones) rather than kvserve's packed GEMM."""
    return any((isinstance(m, torch.nn.Linear) and m.weight is not None)
               or (isinstance(m, QuantizedLinear) and m.packed is None)
               for m in model.modules())


def _own_code(fn, instance):
    """fn bound to instance through a copy of its code object. Dynamo keeps
    compiled graphs per code object: with a copy, a second engine in the process
    (tests, benchmarks) compiles graphs of its own, and it does not share the
    first one's limit of 8 graphs per function."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    return types.MethodType(own, instance)


class CompiledModel:
    """The model's decode logits and hidden states, compiled once `ready`."""

    def __init__(self, model: DecoderModel, paged_decode: bool = False,
                 lora: bool = False, cpp_wrapper: bool = False,
                 device: torch.device = torch.device("cpu"),
                 packages: PackagedForward | None = None):
        self.model = model
        # The graphs as AOTInductor packages (packaged_forward.py) instead of
        # Dynamo's, where given.
        self.packages = packages
        self.on_cpu = device.type == "cpu"
        # With LoRA on, each graph has a twin taking a step's adapters (LoRAStep's
        # stacks are graph inputs), built beside it so no step waits for one.
        self.lora = lora
        # The decode graphs take a PagedDecode (attention traced in), else they call
        # the attention custom op; a graph is built for one of the two only.
        self.paged_decode = paged_decode
        # Frozen weights (constants, prepacked once for oneDNN) where torch does the
        # GEMMs on CPU. Not on CUDA: nothing is prepacked for cuBLAS, and frozen
        # graphs are never cached (every start would trace and lower them again).
        # Set globally: passed in `options`, freezing is not applied.
        torch._inductor.config.freezing = self.frozen = self.on_cpu and torch_gemms(model)
        self._compile_graphs(cpp_wrapper)
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.seconds: float | None = None

    def _compile_graphs(self, cpp_wrapper: bool) -> None:
        """The three graphs' functions (each built at its first call)."""
        self.cpp_wrapper = cpp_wrapper
        self.options = {**MODEL_UNCHECKED, **(CPP_WRAPPER if cpp_wrapper else {})}
        self._one = self._batch_one(BATCH_ONE if self.on_cpu else {})
        # A copy each: torch.compile pops guard_filter_fn from the dict it is given.
        self._many = torch.compile(_own_code(CompiledModel._decode_many, self),
                                   options=dict(self.options))
        self._hidden = torch.compile(_own_code(CompiledModel._hidden_many, self),
                                     options=dict(self.options))

    def _batch_one(self, options: dict):
        """The batch-1 decode graph. With the paged decode (CPU) its steps call it
        directly, past Dynamo's frame, once it is built (engine/runner/direct_graph.py)."""
        options = {**options, **self.options}
        self.batch_one_options = dict(options)  # (for tests: `options` is popped)
        self.direct_one: DirectCall | None = None
        self._recorder = None
        fn = _own_code(CompiledModel._decode_one, self)
        if not self.paged_decode:
            return torch.compile(fn, dynamic=False, options=options)
        guard_filter_fn = options.pop("guard_filter_fn")
        self._recorder = GraphRecorder(options)
        return torch.compile(fn, dynamic=False, backend=self._recorder,
                             options={"guard_filter_fn": guard_filter_fn})

    # Three functions, so each graph has a code object (and a cache) of its own.
    def _decode_one(self, ids, positions, paged, lora=None):
        return self.model.compute_logits(self.model(ids, positions, paged=paged, lora=lora))

    def _decode_many(self, ids, positions, paged, lora=None):
        return self.model.compute_logits(self.model(ids, positions, paged=paged, lora=lora))

    def _hidden_many(self, ids, positions, lora=None):
        return self.model(ids, positions, lora=lora)

    def decode_logits(self, ids: torch.Tensor, positions: torch.Tensor,
                      paged: PagedDecode | None = None, lora: LoRAStep | None = None
                      ) -> torch.Tensor:
        """Logits of every row of a decode-only step (the attention context set).
        paged: the step's attention inputs where attention can be traced into the
        graph (the CPU paged decode); the attention custom op is called otherwise."""
        if not self.ready.is_set():
            return self.model.compute_logits(self.model(ids, positions, paged=paged,
                                                        lora=lora))
        if self.packages is not None:
            return self.packages.decode_logits(ids, positions, paged)
        with self._own_freezing():
            return self._compiled_decode(ids, positions, paged, lora)

    def _compiled_decode(self, ids, positions, paged, lora=None):
        if len(ids) == 1:
            return self._decode_alone(ids, positions, paged, lora)
        return self._many(*dynamic(ids, positions), dynamic_paged(paged),
                          dynamic_lora(lora))

    def _decode_alone(self, ids, positions, paged, lora):
        """One request's decode step: the batch-1 graph called directly where it can
        be, else through Dynamo, which records the direct call when it compiles."""
        if paged is None or self._recorder is None or paged.groups:
            # (a hybrid model's layer groups' tables: not among the direct call's
            # flat inputs, so Dynamo's frame it is)
            return self._one(ids, positions, dynamic_groups(paged, batch=False), lora)
        step_args = (ids, positions, *paged)
        if lora is None and self.direct_one is not None:
            out = self.direct_one(*step_args)
            if out is not None:
                return out[0]
        torch._dynamo.mark_dynamic(paged.block_tables, 1)  # the context grows
        self._recorder.last = None
        logits = self._one(ids, positions, paged, lora)
        if lora is None and self._recorder.last is not None:
            self.direct_one = self._direct(self._recorder.last, logits, step_args)
            self._recorder.last = None  # it holds this call's inputs
        return logits

    def _direct(self, compiled, logits: torch.Tensor, step_args: tuple
                ) -> DirectCall | None:
        """The direct call of the batch-1 graph just compiled by a call of these step
        inputs, if it gives that call's logits again (its K/V write is the same)."""
        direct = DirectCall.build(compiled, step_args, model_tensors(self.model))
        out = direct(*step_args) if direct is not None else None
        if out is None or len(out) != 1 or not torch.equal(out[0], logits):
            log.warning("batch-1 decode steps go through Dynamo: the compiled graph "
                        "could not be called directly")
            return None
        return direct

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor,
               lora: LoRAStep | None = None) -> torch.Tensor:
        """Final hidden states of any step (the attention context set)."""
        if not self.ready.is_set() or len(ids) < 2:
            return self.model(ids, positions, lora=lora)
        if self.packages is not None:
            return self.packages.hidden(ids, positions)
        with self._own_freezing():
            return self._hidden(*dynamic(ids, positions), dynamic_lora(lora))

    def _own_freezing(self):
        """This model's freezing for a graph built again at a call (a guard failed:
        in tests, another engine of the process loaded kvserve's CPU kernels since),
        if another engine set the global otherwise since (a frozen model's batch-1
        graph has no GEMM kernel unfrozen)."""
        if torch._inductor.config.freezing == self.frozen:
            return contextlib.nullcontext()
        return torch._inductor.config.patch(freezing=self.frozen)

    def build(self, run_step: Callable[[Callable, int, bool], None], background: bool,
              on_ready: Callable[[], None] = lambda: None) -> threading.Thread | None:
        """Compiles the three graphs (and their LoRA twins). run_step(fn, num_tokens,
        decode, lora) runs fn(ids, positions) over a harmless step of that many
        tokens (decode: one per request, else one request's), its attention context
        set (the runner knows how), with adapter inputs if `lora`. background: on a thread, steps staying eager meanwhile. on_ready runs
        once they are built, before steps use them. Packages all on disk are loaded
        and warmed up before this returns, background or not: a second or two, and
        no step runs eagerly (loading held the GIL: a request sent meanwhile took
        4.5x an idle eager one)."""
        if self.packages is not None and self.packages.on_disk(self._package_plan()):
            background = False
        if not background:
            self._build(run_step, on_ready)
            return None
        thread = threading.Thread(target=self._build, args=(run_step, on_ready),
                                  name="kvserve-compile", daemon=True)
        track_build(thread)
        thread.start()
        return thread

    def _package_plan(self) -> Plan:
        return self.packages.plan(self.frozen, [BATCH_ONE, BATCH_ONE_FALLBACK])

    def _build(self, run_step, on_ready, t0: float | None = None) -> None:
        t0 = time.perf_counter() if t0 is None else t0
        try:
            self._build_graphs(run_step)
        except Exception as exc:  # noqa: BLE001 - eager steps go on; said once
            if self.cpp_wrapper:  # newer in Inductor than the Python one: not fatal
                log.warning("compiling the forward pass with C++ wrappers failed (%s); "
                            "building it with Python wrappers", exc, exc_info=True)
                self._compile_graphs(cpp_wrapper=False)
                return self._build(run_step, on_ready, t0)
            self.failed = exc
            log.warning("compiling the forward pass failed, steps stay eager: %s", exc,
                        exc_info=True)
            return
        self.seconds = time.perf_counter() - t0
        on_ready()
        if self.packages is not None:
            log.info("forward pass ready in %.1f s from AOTInductor packages (%s)",
                     self.seconds, self.packages.store.root)
            return self.ready.set()
        log.info("forward pass compiled in %.1f s (%s, %s wrappers; Inductor cache: %s)",
                 self.seconds, "weights frozen for torch's GEMMs, graphs built anew at "
                 "every start" if self.frozen else "weights as graph inputs, graphs cached",
                 "C++" if self.cpp_wrapper else "Python",
                 os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default"))
        self.ready.set()
        trim_cache()  # frozen graphs' libraries hold copies of the weights

    def _build_graphs(self, run_step) -> None:
        if self.packages is not None:
            try:
                return self.packages.build_all(self._package_plan(), run_step)
            except Exception as exc:  # noqa: BLE001 - Dynamo's graphs instead, said once
                log.warning("building the forward pass ahead of time failed (%s); "
                            "compiling it with Dynamo", exc, exc_info=True)
                self.packages = None
        # Example sizes: what each graph mostly runs (oneDNN packs for them).
        plan = [("decode, 1 request", self._compiled_decode, 1, True),
                ("decode, 2+ requests", self._compiled_decode, 16, True),
                ("mixed steps", marking(self._hidden), 256, False)]
        plan = [(what + suffix, *rest, lora) for lora, suffix in
                ((False, ""), (True, ", LoRA"))[:1 + self.lora] for what, *rest in plan]
        # This model's choice even if another engine of the process set the global
        # since.
        with torch.inference_mode(), torch._inductor.config.patch(freezing=self.frozen):
            for i, (what, fn, tokens, decode, lora) in enumerate(plan, 1):
                log.info("compiling the forward pass (%d/%d: %s)...", i, len(plan), what)
                self._warm_up(run_step, fn, tokens, decode, lora)

    def _warm_up(self, run_step, fn, tokens: int, decode: bool, lora: bool) -> None:
        """run_step, and for the batch-1 graph once more with oneDNN allowed if the
        GEMV template alone left a GEMM without a kernel."""
        try:
            run_step(fn, tokens, decode, lora)
        except Exception as exc:  # noqa: BLE001 - one kind is retried, the rest raised
            if tokens != 1 or not self.on_cpu or "NoValidChoicesError" not in str(exc):
                raise
            log.info("batch-1 decode: Inductor's GEMV template does not cover every "
                     "GEMM of this model; oneDNN allowed where it does not")
            self._one = self._batch_one(BATCH_ONE_FALLBACK)
            run_step(fn, tokens, decode, lora)
