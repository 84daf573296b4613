"""Which forward pass a step takes, decided in one place from what the parts say they
can do (vLLM's CUDA-graph dispatcher plays this role there).

The paths, the most specialised first:
- decode graphs: a decode-only step (one new token a request, nothing but sampling)
  through padded static buffers, replayed as CUDA graphs where they were captured
  (engine/runner/cuda_graphs.py);
- compiled decode: a step whose every row is a decode the backend can trace into the
  compiled graph (its paged decode), the LM head in the graph too (on CPU at batch 1
  called past Dynamo's frame: engine/runner/direct_graph.py);
- compiled hidden: any other step once the graphs are ready, attention through the
  custom op;
- eager: the model's own forward pass, before the graphs are ready or without them.

Backends declare what they can do: `graph_safe` (capturable), `traces_paged_decode`
(decode attention traceable into a graph), `in_place_reader()` (the same backend
reading K/V where they lie) and `traced_decode(meta)` (a step's inputs for that
graph). When the compiled graphs are ready, this swaps its backend for the in-place
reader the graphs were warmed up with; nothing sets a backend's flag from outside
(a backend's forward reads only the metadata, so a step prepared on the old one runs
as it was prepared)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvserve.engine.kernels.attention.backend import AttentionBackend
from kvserve.engine.kernels.attention.context import GroupSteps
from kvserve.engine.kernels.attention.cpu_paged import PagedDecode
from kvserve.engine.lora.manager import LoRAManager
from kvserve.engine.runner.compiled_model import CompiledModel
from kvserve.engine.runner.cuda_graphs import DecodeGraphPlan, DecodeGraphs
from kvserve.engine.runner.graph_packages import GraphPackages, applies
from kvserve.engine.runner.packaged_forward import PackagedForward
from kvserve.engine.runner.step_batch import FlatBatch
from kvserve.scheduler.output import ScheduledRequest

# warm_up(backend, fn, num_tokens, decode, lora): one warm-up step through a compiled
# function (the runner's, which owns the KV cache's spare block it writes).
WarmUp = Callable[[AttentionBackend, Callable, int, bool, bool], None]


class ForwardPaths:
    def __init__(self, model, backend: AttentionBackend, device: torch.device,
                 block_size: int, lora: LoRAManager | None = None, window_groups: int = 0):
        self.model, self.device, self.block_size, self.lora = model, device, block_size, lora
        self.window_groups = window_groups  # a hybrid model's sliding layer groups
        self.backend = backend  # the one steps prepare with now
        self.decode_graphs: DecodeGraphs | None = None
        # The compiled graphs: being built, or built (`compiling.ready`); steps take
        # them from when `compiled` is set, once they are ready.
        self.compiling: CompiledModel | None = None
        self.compiled: CompiledModel | None = None

    def use_decode_graphs(self, plan: DecodeGraphPlan) -> None:
        """Decode-only steps go through padded static buffers from now on (tests
        switch an engine's runner over to the eager padded path with this)."""
        if plan.capture and not (self.device.type == "cuda" and self.backend.graph_safe):
            raise ValueError("CUDA graphs need CUDA and a graph-safe attention backend")
        self.decode_graphs = DecodeGraphs(self.model, self.backend, self.block_size,
                                          plan.max_num_seqs, plan.max_model_len,
                                          self.device, plan.capture, self.lora,
                                          self.window_groups)
        if plan.capture:
            self.decode_graphs.capture_all()

    def compile(self, background: bool, warm_up: WarmUp, packages: Path | None = None,
                build_packages: Callable[[], None] | None = None) -> CompiledModel:
        """Steps go through Inductor-compiled graphs once they are built (on a thread
        of their own with `background`, steps staying eager meanwhile). Where the
        backend traces its paged decode (on CPU), decodes are traced into the graphs
        and prompt chunks read K/V in place too: the graphs are warmed up through the
        in-place reader, and steps prepare with it from when the graphs are ready (a
        step keeps the path it was prepared on). packages: the graphs as AOTInductor
        packages kept there, where they apply (graph_packages.py), those missing
        built by build_packages (None: here)."""
        traced = self.backend.traces_paged_decode and self.device.type == "cpu"
        packaged = (PackagedForward(GraphPackages(self.model, packages), build_packages)
                    if packages is not None and traced
                    and applies(self.model, self.device, self.lora is not None) else None)
        compiled = self.compiling = CompiledModel(self.model, paged_decode=traced,
                                                  lora=self.lora is not None,
                                                  cpp_wrapper=self.device.type == "cpu",
                                                  device=self.device, packages=packaged)
        warm_backend = self.backend.in_place_reader() if traced else self.backend

        def ready() -> None:
            self.backend = warm_backend
            self.compiled = compiled

        compiled.build(lambda fn, n, decode, lora: warm_up(warm_backend, fn, n, decode, lora),
                       background, ready)
        return compiled

    def takes_decode_graphs(self, scheduled: list[ScheduledRequest], drafter) -> bool:
        """A decode-only step the padded (captured) forward pass can run."""
        g = self.decode_graphs
        if drafter is not None and drafter.observes_batches:
            return False  # the draft model must see the batch: eager steps
        return (g is not None and g.fits(len(scheduled))
                and all(s.num_new_tokens == 1 and not s.spec_token_ids for s in scheduled)
                and not any(s.request.needs_prompt_logits or s.request.params.pooling
                            for s in scheduled))

    def run(self, batch: FlatBatch) -> tuple[torch.Tensor, bool]:
        """The step's forward pass, under its attention context: (the logits of every
        row, True) where the graph computed them, else (the hidden states, False)."""
        compiled = self.compiled
        if compiled is None:
            return self.model(batch.input_ids, batch.positions, lora=batch.lora), False
        traced = traced_decode(self.backend, batch.attention)
        decode_only = (batch.rows.num_sample == batch.rows.total == len(batch.input_ids)
                       and not batch.pooling)  # pooling needs the hidden rows
        if decode_only and (traced is not None or not compiled.paged_decode):
            # Every row samples, in order (one graph, LM head in it).
            return compiled.decode_logits(batch.input_ids, batch.positions, traced,
                                          batch.lora and batch.lora.gathered()), True
        # Mixed steps, and a decode step prepared before the graphs were ready (no
        # traced inputs): the graph that calls the custom op.
        return compiled.hidden(batch.input_ids, batch.positions, batch.lora), False


def traced_decode(backend: AttentionBackend, meta) -> PagedDecode | None:
    """The backend's traced-decode inputs of a prepared step; a hybrid model's
    (GroupSteps) carry every layer group's tables and slots. None: not traceable."""
    if type(meta) is not GroupSteps:
        return backend.traced_decode(meta)
    parts = [backend.traced_decode(m) for m in meta]
    if any(p is None for p in parts):
        return None
    return parts[0]._replace(groups=tuple((p.block_tables, p.slots) for p in parts[1:]))
