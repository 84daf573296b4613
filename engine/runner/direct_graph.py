"""A compiled graph called directly, without Dynamo's frame around it.

Why: a batch-1 decode step of the default model hands 371 tensors to its graph (every
weight, both KV caches of every layer, the step's inputs). Through torch.compile each
call evaluates the frame's guards, gathers the model's tensors by attribute chains
(Dynamo's bytecode) and passes AOT autograd's wrappers: 0.86-0.97 ms of a ~15 ms
batch-1 int8 step on two AVX2 cores, 1.3 ms with the shipped weights' int4 layers
(more tensors), the same graph giving bit-identical logits (bench/direct_call_ab.py,
steps alternating between the two ways in one engine;
bench/results/cpu_direct_call_avx2_2026-11-26.md).

How: `GraphRecorder` is the torch.compile backend of such graphs. It compiles each
graph with Inductor as the default backend would (compile_fx, the same options) and
keeps what it takes: Dynamo's example inputs, in the graph's order, and the graph's
placeholders. `DirectCall.build` then finds where each input comes from at a call:
- a step input: the very tensor the compiling call was given (found by identity),
  checked at each call for the dtype, rank, fixed sizes and contiguity it had there;
- a size (a SymInt): the dims of step inputs whose fake example holds that symbol,
  checked at each call to be equal and at least 2 (Dynamo's duck sizing and 0/1
  specialisation would have guarded both);
- a tensor of the model (a weight, a KV cache, a scale): kept as it is. These never
  change once the graphs are built: compiled_model.py's MODEL_UNCHECKED drops
  Dynamo's guards on them for the same reason.
A graph with an input of any other kind gets no DirectCall; a call whose step inputs
fail a check returns None, and the caller goes through Dynamo as before (which
recompiles if it must)."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn


class Compiled(NamedTuple):
    """One graph as the backend compiled it."""
    fn: Callable  # takes the graph's inputs, in order, as positional arguments
    example_inputs: list  # what Dynamo gave the backend: tensors and SymInts
    fakes: list  # each placeholder's fake example (symbolic sizes), same order


class GraphRecorder:
    """A torch.compile backend: Inductor, keeping each graph it compiles (`last`)."""

    def __init__(self, inductor_options: dict):
        self.inductor_options = inductor_options
        self.last: Compiled | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        fn = compile_fx(gm, example_inputs, config_patches=self.inductor_options)
        self.last = Compiled(fn, list(example_inputs), fakes)
        return fn


class _StepInput(NamedTuple):
    arg: int  # which of the call's step inputs
    dtype: torch.dtype
    sizes: tuple  # an int where the size is fixed, None where it is a symbol
    contiguous: bool


class DirectCall:
    """Calls one compiled graph with the model's tensors it took at compile time and
    a call's step inputs in their places (see the module's docstring)."""

    def __init__(self, fn: Callable, template: list, step_slots: list[int],
                 step_inputs: list[_StepInput], size_slots: list[tuple[int, list]]):
        self._fn = fn
        self._template = template  # the model's tensors; None where a call's go
        self._step_slots = step_slots  # where each step input goes
        self._step_inputs = step_inputs
        self._size_slots = size_slots  # (slot, [(step input, dim), ...]) per symbol

    @classmethod
    def build(cls, compiled: Compiled, step_args: tuple[torch.Tensor, ...],
              model_tensors: set[int]) -> DirectCall | None:
        """The direct call of `compiled`, compiled by a call whose step inputs were
        `step_args` (tensors, in the order calls will give them); None where one of
        its inputs is neither a step input, a size of one, nor a model tensor."""
        by_id = {id(t): i for i, t in enumerate(step_args)}
        template, step_slots, step_inputs, symbols, step_shapes = [], [], [], [], []
        for slot, (value, fake) in enumerate(zip(compiled.example_inputs, compiled.fakes)):
            if isinstance(value, torch.SymInt):
                symbols.append((slot, value.node.expr))
                template.append(None)
            elif isinstance(value, torch.Tensor) and id(value) in by_id and fake is not None:
                arg = by_id[id(value)]
                step_slots.append(slot)
                step_inputs.append(_StepInput(
                    arg, value.dtype, tuple(s if isinstance(s, int) else None for s in fake.shape),
                    value.is_contiguous()))
                step_shapes.append((arg, fake.shape))
                template.append(None)
            elif isinstance(value, torch.Tensor) and id(value) in model_tensors:
                template.append(value)
            else:
                return None
        size_slots = []
        for slot, expr in symbols:
            dims = [(arg, d) for arg, shape in step_shapes for d, size in enumerate(shape)
                    if isinstance(size, torch.SymInt) and size.node.expr == expr]
            if not dims:
                return None
            size_slots.append((slot, dims))
        return cls(compiled.fn, template, step_slots, step_inputs, size_slots)

    def __call__(self, *step_args: torch.Tensor):
        """The graph's outputs, or None where a step input is not as the graph was
        compiled for (the caller then goes through Dynamo)."""
        args = self._template.copy()
        for slot, want in zip(self._step_slots, self._step_inputs):
            t = step_args[want.arg]
            if (t.dtype != want.dtype or t.dim() != len(want.sizes)
                    or any(w is not None and w != s for w, s in zip(want.sizes, t.shape))
                    or (want.contiguous and not t.is_contiguous())):
                return None
            args[slot] = t
        for slot, dims in self._size_slots:
            sizes = {step_args[arg].shape[d] for arg, d in dims}
            if len(sizes) != 1 or min(sizes) < 2:
                return None
            args[slot] = sizes.pop()
        return self._fn(*args)


def model_tensors(model: nn.Module) -> set[int]:
    """ids of every tensor a module tree holds: parameters, buffers, and tensors kept
    as plain attributes or tuples of them (KV caches, their scales)."""
    found: set[int] = set()
    for module in model.modules():
        found.update(id(t) for t in _tensors(vars(module).values()))
        found.update(id(t) for t in module.parameters(recurse=False))
        found.update(id(t) for t in module.buffers(recurse=False))
    return found


def _tensors(values: Iterable) -> Iterable[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from (t for t in v if isinstance(t, torch.Tensor))
