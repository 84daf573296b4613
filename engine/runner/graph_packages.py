"""The CPU forward pass's compiled graphs as AOTInductor packages, kept on disk, so a
warm start loads them in about a second instead of tracing and lowering them again.

Why: Dynamo's graphs are rebuilt at every start (tracing, AOT autograd, lowering),
and where torch does the GEMMs the weights are frozen into oneDNN's packed layout,
which Inductor's graph cache refuses ("mkldnn tensors unpickleable"): the default
model's three graphs took 210 s to build on every start of a 2-core Zen 4
(bench/results/startup_cpu_2026-11-29.md). A package is the graph exported
(torch.export), compiled ahead of time by Inductor with the same options (the
batch-1 GEMV template, frozen weights where torch does the GEMMs) and kept unpacked:
loading one is a dlopen.

What a package takes: the step's inputs (ids, positions, and for the decode graphs
the step's `PagedDecode` tensors) and every layer's KV cache tensors, as inputs it
writes in place. The caches are inputs rather than constants so the package never
holds a copy of them and fits any number of blocks (their first dimension is
dynamic). Everything else the forward pass reads (weights, rotary tables) is a
constant of the package: where every linear layer runs on kvserve's GEMM (nothing
frozen) the constants stay out of its library and are bound at load to the model's
own tensors, so every graph reads the one copy (package_constants.py); frozen
graphs (torch's oneDNN GEMMs: float32 on AVX-512 CPUs, bf16 without AVX512-BF16)
hold copies of their own, folded into oneDNN's layout (0.2 s to load the default
model's, 3.6-7.5 s a 1B model's, with the GIL held).

The key: everything that changes the compiled code or its constants: kvserve's
engine sources, torch's version, the CPU's flags, the model's config and a sample
of every weight's bytes (`weights_digest`), the dtypes, the KV cache's block shape,
the graph's kind and Inductor's options. A package built under another key is never
loaded; packages are written to a temporary name and renamed, so a crash leaves no
half-written one.

Used where it applies (`applies`): on CPU, one (K, V) pair per layer on every layer
(no latent or hybrid caches), no LoRA. Elsewhere the graphs are built by Dynamo as
before (compiled_model.py)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch
from torch import nn

from kvserve.engine.kernels.attention.cpu_paged import PagedDecode
from kvserve.engine.kernels.cpu.c_shims import c_shims
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.runner.package_constants import (IN_LIBRARY, attributes_as_buffers, bind,
                                                     bound_names, model_tensors,
                                                     shares_weights, unshared)

log = logging.getLogger("kvserve.compile")

KINDS = ("decode_one", "decode_many", "hidden")
# Samples of each weight's bytes in the key: fine-tuning, merging or requantizing
# changes nearly every element, so any of them changes the samples; a change that
# fell between two samples of every tensor would go unseen.
SAMPLES_PER_TENSOR = 4096
ENGINE = Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def source_digest() -> str:
    """kvserve's engine sources as installed: a change to the model code, a kernel
    or an op's schema gives new packages."""
    digest = hashlib.sha256()
    for path in sorted(p for p in ENGINE.rglob("*") if p.suffix in SOURCE_SUFFIXES):
        digest.update(str(path.relative_to(ENGINE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def weights_digest(model: nn.Module) -> str:
    """Every parameter's and buffer's name, dtype, shape and SAMPLES_PER_TENSOR of its
    elements' bytes, evenly spaced (hashing every byte of an 8B model's weights
    would take seconds of every start)."""
    digest = hashlib.sha256()
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in sorted(tensors):
        t = tensors[name].detach()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        flat = t.reshape(-1)
        step = max(1, flat.numel() // SAMPLES_PER_TENSOR)
        digest.update(flat[::step].contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def attention_layers(model: nn.Module) -> list[nn.Module] | None:
    """Each layer's attention module if each holds a (K, V) pair of its own, else
    None (latent caches, layer groups sharing pairs)."""
    layers = [getattr(layer, "self_attn", None) for layer in model.layers]
    pairs = [(getattr(a, "k_cache", None), getattr(a, "v_cache", None)) for a in layers]
    if any(k is None or k is v or getattr(a, "kv_group", 0)
           for a, (k, v) in zip(layers, pairs)):
        return None
    if len({id(k) for k, _ in pairs}) != len(pairs):
        return None
    return layers


def applies(model: nn.Module, device: torch.device, lora: bool) -> bool:
    """Whether the graphs can be packaged: CPU, a (K, V) pair per layer, no LoRA."""
    return (device.type == "cpu" and not lora and hasattr(model, "layers")
            and attention_layers(model) is not None)


class _WithCaches(nn.Module):
    """fn(step inputs) with every layer's K/V caches passed in as inputs: during the
    call each attention module reads and writes the ones given (torch.export lifts
    the model's own as constants, which a package could not write)."""

    def __init__(self, model: nn.Module, fn: Callable):
        super().__init__()
        self.model, self.fn = model, fn
        self.layers = attention_layers(model)

    def forward(self, step: tuple[torch.Tensor, ...], caches: tuple[torch.Tensor, ...]):
        saved = [(a.k_cache, a.v_cache) for a in self.layers]
        try:
            for i, a in enumerate(self.layers):
                a.k_cache, a.v_cache = caches[2 * i], caches[2 * i + 1]
            return self.fn(*step)
        finally:
            for a, (k, v) in zip(self.layers, saved):
                a.k_cache, a.v_cache = k, v


class PackagedGraph:
    """One loaded package: called with the step's inputs, it passes the KV caches.

    Loaded from the package's model folder, kept unpacked (`unpack`): the package
    loader would extract its ~300 MB library to a temporary folder at every load
    (and aoti_load_package tries another loader first), holding the GIL 0.4-0.7 s a
    graph where the library's own runner takes 0.2 s, a stall every step waits out
    when a finished build is handed to a serving process. Its constants are then
    pointed at the model's tensors where it was built to share them
    (package_constants.py)."""

    def __init__(self, folder: Path, caches: list[torch.Tensor],
                 tensors: dict[str, torch.Tensor]):
        (library,) = folder.glob("*.so")  # its .json beside it: the custom ops' calls
        self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)
        bind(self.runner, folder, tensors)
        self.caches = caches

    def __call__(self, *step: torch.Tensor) -> torch.Tensor:
        # The runner's own call: no pytree pass over ~65 inputs a step (a package's)
        return self.runner.run([*step, *self.caches])[0]


def unpack(package: Path, folder: Path, extra: dict[str, str] | None = None) -> None:
    """The package's model files (its library, the library's .json, sources and
    metadata) and `extra` ones (name: text) into `folder`, written under a temporary
    name and renamed."""
    partial = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        with zipfile.ZipFile(package) as archive:
            for entry in archive.infolist():
                if "/data/aotinductor/model/" in entry.filename and not entry.is_dir():
                    with archive.open(entry) as src, open(
                            partial / Path(entry.filename).name, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 22)
        if not list(partial.glob("*.so")):
            raise RuntimeError(f"{package} holds no compiled library")
        for name, text in (extra or {}).items():
            (partial / name).write_text(text)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def remove_compile_output(folder: Path) -> None:
    """AOTInductor's own copy of a package's files, left in Inductor's cache
    (<cache>/<hash>/<library>) where nothing reads them again once the package is
    unpacked: for a frozen graph a library holding a copy of the weights (6.5 GB
    for a 1B model's three, beside the packages' own)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    for library in folder.glob("*.so"):
        for leftover in Path(cache_dir()).glob(f"*/{library.name}"):
            shutil.rmtree(leftover.parent, ignore_errors=True)


def step_inputs(kind: str, ids: torch.Tensor, positions: torch.Tensor,
                paged: PagedDecode | None) -> tuple[torch.Tensor, ...]:
    """The package's step inputs, flat, in its order."""
    if kind == "hidden":
        return ids, positions
    return ids, positions, paged.block_tables, paged.seq_lens, paged.slots


def _dynamic_shapes(kind: str, caches: list[torch.Tensor]):
    dim = torch.export.Dim
    blocks = dim("blocks", min=2)
    cache_dims = tuple({0: blocks} for _ in caches)
    if kind == "hidden":
        tokens = dim("tokens", min=2)
        return ({0: tokens}, {0: tokens}), cache_dims
    width = dim("width", min=2)
    if kind == "decode_one":
        return ({}, {}, {1: width}, {}, {}), cache_dims
    rows = dim("rows", min=2)
    return ({0: rows}, {0: rows}, {0: rows, 1: width}, {0: rows}, {0: rows}), cache_dims


def _jsonable(value):
    if is_dataclass(value):
        return {k: _jsonable(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)


class GraphPackages:
    """The packages of one model's graphs under `root` (one folder per key)."""

    def __init__(self, model: nn.Module, root: Path):
        self.model, self.root = model, Path(root)
        layers = attention_layers(model)
        self.caches = [t for a in layers for t in (a.k_cache, a.v_cache)]
        cache = self.caches[0]
        self.facts = {
            "engine": source_digest(), "torch": torch.__version__,
            "cpu_flags": sorted(cpu_flags()), "config": _jsonable(model.config),
            "weights": weights_digest(model), "cache": [str(cache.dtype),
                                                        list(cache.shape[1:])]}

    def key(self, kind: str, options: dict) -> str:
        facts = {**self.facts, "kind": kind, "options": _jsonable(options)}
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]

    def path(self, kind: str, options: dict) -> Path:
        """The package's model folder (unpacked)."""
        return self.root / self.key(kind, options) / kind

    def load(self, kind: str, options: dict) -> PackagedGraph | None:
        """The package of this key if one was saved, loaded; else None."""
        path = self.path(kind, options)
        if not path.is_dir():
            return None
        t0 = time.perf_counter()
        graph = PackagedGraph(path, self.caches, model_tensors(self.model))
        log.info("loaded the %s graph from %s in %.1f s", kind, path.parent,
                 time.perf_counter() - t0)
        return graph

    def build(self, kind: str, fn: Callable, step: tuple[torch.Tensor, ...],
              options: dict) -> PackagedGraph:
        """Exports fn over these example step inputs, compiles it with Inductor's
        `options`, saves the package under its key and loads it."""
        path = self.path(kind, options)
        t0 = time.perf_counter()
        wrapped = _WithCaches(self.model, fn)
        with attributes_as_buffers(self.model, self.caches):
            exported = torch.export.export(wrapped, (step, tuple(self.caches)),
                                           dynamic_shapes=_dynamic_shapes(kind, self.caches),
                                           strict=False)
        tensors = model_tensors(self.model)
        shared = shares_weights(options) and not unshared(exported, tensors)
        if shares_weights(options) and not shared:
            log.info("the %s graph makes constants of its own (%s): its package keeps "
                     "a copy of the weights", kind, ", ".join(unshared(exported, tensors)[:3]))
        path.parent.mkdir(parents=True, exist_ok=True)
        package = path.with_name(f".{kind}.{os.getpid()}.pt2")
        try:
            # (the C entry points of kvserve's ops are not part of the key: which ops a
            # process has loaded is no property of the graph, and the engine's
            # sources, which declare them, are)
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(package),
                inductor_configs={**options, IN_LIBRARY: not shared,
                                  "aot_inductor.custom_ops_to_c_shims": c_shims()})
            unpack(package, path, bound_names(exported) if shared else None)
        finally:
            package.unlink(missing_ok=True)
        remove_compile_output(path)
        (path.parent / "key.json").write_text(json.dumps(
            {**self.facts, "kind": kind, "options": _jsonable(options)}, indent=1))
        log.info("compiled the %s graph ahead of time in %.1f s: %s", kind,
                 time.perf_counter() - t0, path)
        self._prune(kind, path.parent)
        return PackagedGraph(path, self.caches, tensors)

    def _prune(self, kind: str, kept: Path) -> None:
        """Removes this graph's packages under older keys of the same model (another
        kvserve or torch, other options): each is the size of the model's weights,
        and an upgrade would otherwise leave one behind every time."""
        model = {"config": self.facts["config"], "weights": self.facts["weights"]}
        for folder in self.root.iterdir():
            try:
                facts = json.loads((folder / "key.json").read_text())
            except (OSError, ValueError):
                continue
            if folder != kept and facts.get("kind") == kind and all(
                    facts.get(k) == v for k, v in model.items()):
                shutil.rmtree(folder, ignore_errors=True)
                log.info("removed the %s graph's package of an older key: %s", kind, folder)

    def failure_marker(self) -> Path:
        """Left by a build that failed for this model here (every kind): later starts
        go straight to Dynamo's graphs instead of failing the same build again.
        Removing it tries again."""
        return self.root / f"{self.key('every graph', {})}.failed"

    def load_or_build(self, kind: str, fn: Callable, step: tuple[torch.Tensor, ...],
                      options: dict) -> PackagedGraph:
        return self.load(kind, options) or self.build(kind, fn, step, options)
