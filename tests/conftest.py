from __future__ import annotations

import gc
import os

import pytest

# Triton kernels run through Triton's CPU interpreter unless told otherwise (a GPU
# host runs the same tests on the device with TRITON_INTERPRET=0). It must be set
# before the first kernel is launched, so here, at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the suite on one pytest-xdist worker per core: parts of it wait
# (servers starting, requests streaming), and two workers kept two cores 183% busy
# (15-21 min against 23 in one process, 2 cores). Each worker, and every server it starts, gets
# one compute thread: two workers each spinning two OpenMP threads on two cores would
# fight over them. Set before torch is imported (it reads the variable then).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch._dynamo

from tests.support.tiny_models import make_tiny_model

# One test process holds engines of many model shapes and dtypes, and the compiled
# CPU paged decode (engine/kernels/attention/cpu_paged.py) is one function shared by all of
# them: a graph per shape passes Dynamo's default limit of 8 per function. A server
# holds one model (and perhaps a draft). Recompilation under load is what the tests
# count themselves (graphs_compiled), unaffected by this limit.
torch._dynamo.config.recompile_limit = 64

# The suite runs eager: every engine compiling its forward pass (a minute of CPU each
# on a cold cache) would take hours. KVSERVE_TEST_COMPILE=wait runs it compiled
# (engines left at --compile auto compile before their first step); the compiled path
# has tests of its own (tests/engine/test_compiled_forward.py) either way.
# Likewise float32 where the dtype is left at auto (which picks bf16 on CUDA and on
# CPUs with native bf16): the tests compare against float32 references, the same on
# any CPU and on a GPU (bench/gpu_session.sh runs the engine tests there).
# And float32 runs on kvserve's CPU kernels (engine/kernels/cpu) wherever the CPU
# has AVX2 and FMA, not only where --cpu-kernels auto picks it (no AVX-512), so every
# CI machine tests the same path. Servers started as subprocesses keep kvserve's own
# defaults.
TEST_COMPILE = os.environ.get("KVSERVE_TEST_COMPILE", "off")


@pytest.fixture(scope="session", autouse=True)
def _batch_dir(tmp_path_factory):
    """Apps built in the suite's process keep /v1/files and /v1/batches in a folder of
    this session, not the user's $KVSERVE_CACHE (tests that restart a server give
    theirs one of its own; servers run as subprocesses make no batches)."""
    root = tmp_path_factory.mktemp("batch")
    patch = pytest.MonkeyPatch()
    patch.setattr("kvserve.server.batch.routes.default_batch_dir", lambda: root)
    yield
    patch.undo()


@pytest.fixture(scope="session", autouse=True)
def _compile_mode():
    """Engines built in this process with compile, dtype, cpu_kernels or compile_cache
    "auto" get TEST_COMPILE, float32 (on any device), kvserve (CPUs with AVX2, FMA
    and F16C) and Dynamo's graphs (tests/engine/test_graph_packages.py asks for
    packages).
    Session-wide, so module- and session-scoped engines get it too."""
    import dataclasses

    from kvserve.engine.weights.cpu_packing import NEEDED_FLAGS
    from kvserve.engine.core.engine import Engine
    from kvserve.engine.platform.device import cpu_flags, resolve_device

    init = Engine.__init__
    packable = set(NEEDED_FLAGS) <= cpu_flags()

    def patched(self, config, *args, **kwargs):
        if config.compile == "auto":
            config = dataclasses.replace(config, compile=TEST_COMPILE)
        if config.compile_cache == "auto":  # Dynamo's graphs: what their tests test
            config = dataclasses.replace(config, compile_cache="off")
        on_cpu = resolve_device(config.device).type == "cpu"
        if config.dtype == "auto":
            config = dataclasses.replace(config, dtype="float32")
        if (config.cpu_kernels == "auto" and on_cpu and config.dtype == "float32"
                and packable):
            config = dataclasses.replace(config, cpu_kernels="kvserve")
        init(self, config, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "__init__", patched)
        yield


@pytest.fixture
def frozen_heap():
    """For a timing guard on work in this process: the objects the suite has piled
    up (1.5 million by its end) frozen out of the garbage collector. Its full
    collections scan them all, and took up to 1.7 s in the suite, stalling whatever
    ran then (a /health answer took 1.22 s against a 0.25 s limit). A server's own
    heap is a fraction of that."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A factory: tiny_model_dir("qwen3") -> a random-weight model directory, made
    once per session and architecture."""
    made = {}

    def make(arch: str = "llama"):
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def default_model_dir():
    from kvserve.modelstore.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_model_dir):
    """make(arch="llama", **EngineConfig overrides) -> a fresh Engine."""
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine

    def make(arch: str = "llama", **overrides):
        cfg = dict(model=str(tiny_model_dir(arch)), num_kv_blocks=512,
                   max_num_batched_tokens=256)
        cfg.update(overrides)
        return Engine(EngineConfig(**cfg))

    return make
