"""One copy of the weights for every graph package (graph_packages.py): a package
built with its constants outside its library is given the model's own tensors when it
is loaded, by the names it knows them by, and reads them where they lie
(AOTInductor's user-managed constants: nothing is copied).

Why: a package that holds its constants is a copy of the model's weights on disk and
a second one in memory once loaded, and a model has three graphs: a 1B model's 2 GB
of bf16 weights were 6.5 GB of packages and ~8 GB resident, and a 3B model's build
ran out of memory on a 24 GiB machine (bench/results/cpu_compare_3b_int8_2026-11-29.md).
Loading a package also copied its weights with the GIL held (3.6-7.5 s a graph at
1B), stalling every step of a serving process that had just been handed the build.

Where the graphs are frozen (torch's oneDNN GEMMs: the weights folded into oneDNN's
layout, which no tensor of the model's holds) packages keep their constants as
before."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

# Inductor's option that keeps a package's constants in (True) or out of its library.
IN_LIBRARY = "aot_inductor.package_constants_in_so"
# Written beside a package whose constants are to be bound: the names it binds.
BOUND = "bound.json"
# c10's ScalarType numbers, as AOTInductor's runner reports its constants' dtypes.
DTYPE_CODES = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3,
               torch.int64: 4, torch.float16: 5, torch.float32: 6, torch.float64: 7,
               torch.bool: 11, torch.bfloat16: 15}


def shares_weights(options: dict) -> bool:
    """Whether a package built with Inductor's `options` keeps its constants out of
    its library: where they are asked to be, and the graph is not frozen."""
    return not options.get("freezing") and not options.get(IN_LIBRARY, True)


def _plain_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's tensor attributes that are neither parameters nor buffers (rotary
    tables kept in float32 whatever the model's dtype)."""
    return {name: value for name, value in vars(module).items()
            if isinstance(value, torch.Tensor)}


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model holds (parameters, buffers and plain tensor attributes)
    by the name a package knows it by (under _WithCaches's `model`), a tied one under
    each of its names."""
    named = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    for prefix, module in model.named_modules(remove_duplicate=False):
        named.update({f"{prefix}.{name}" if prefix else name: value
                      for name, value in _plain_tensors(module).items()})
    return {f"model.{name}": t for name, t in named.items()}


@contextlib.contextmanager
def attributes_as_buffers(model: nn.Module, inputs: list[torch.Tensor]):
    """The model's plain tensor attributes registered as non-persistent buffers while
    a graph is exported, so that its package names them by their path (as
    model_tensors does) rather than as anonymous constants; put back after. `inputs`
    (the KV caches, which the graph takes as inputs) are left as they are."""
    added, skip = [], {id(t) for t in inputs}
    for module in model.modules():
        for name, value in _plain_tensors(module).items():
            if id(value) in skip:
                continue
            delattr(module, name)
            module.register_buffer(name, value, persistent=False)
            added.append((module, name, value))
    try:
        yield
    finally:
        for module, name, value in added:
            del module._buffers[name]
            setattr(module, name, value)


def unshared(exported: torch.export.ExportedProgram, tensors: dict[str, torch.Tensor]
             ) -> list[str]:
    """The exported graph's constants that are none of the model's tensors (made
    during the forward pass): a package of it must keep its constants."""
    return [name for name in (*exported.state_dict, *exported.constants)
            if name not in tensors]


def bound_names(exported: torch.export.ExportedProgram) -> dict[str, str]:
    """The file recording, beside a package built with its constants outside, that
    they are to be bound at load (and to which of the model's tensors): name: text."""
    return {BOUND: json.dumps(sorted((*exported.state_dict, *exported.constants)), indent=0)}


def bind(runner, folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A loaded package's constants pointed at the model's tensors, if it was built
    to be (BOUND); each checked to be the dtype it was compiled for."""
    if not (folder / BOUND).exists():
        return
    dtypes = runner.get_constant_names_to_dtypes()
    bound = {}
    for name, fqn in runner.get_constant_names_to_original_fqns().items():
        tensor = tensors.get(fqn)
        if tensor is None or DTYPE_CODES.get(tensor.dtype) != dtypes[name]:
            raise RuntimeError(f"{folder}: the package's constant {fqn} is not a tensor "
                               "of this model's")
        bound[name] = tensor
    # (use_inactive, validate_full_update, user_managed): the buffer in use, every
    # constant given, the tensors themselves rather than copies of them
    runner.update_constant_buffer(bound, False, True, True)
