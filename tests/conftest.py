from __future__ import annotations

import os

import pytest

# Triton kernels run through Triton's CPU interpreter unless told otherwise (a GPU
# host runs the same tests on the device with TRITON_INTERPRET=0). It must be set
# before the first kernel is launched, so here, at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.tiny_models import make_tiny_model


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
    from modelstore.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_model_dir):
    """make(arch="llama", **EngineConfig overrides) -> a fresh Engine."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    def make(arch: str = "llama", **overrides):
        cfg = dict(model=str(tiny_model_dir(arch)), num_kv_blocks=512,
                   max_num_batched_tokens=256)
        cfg.update(overrides)
        return Engine(EngineConfig(**cfg))

    return make
