"""KV-cache sizing: the arithmetic of --gpu-memory-utilization, the profile step
(run on CPU here for its code; its memory is only measured on CUDA), and the CPU
default."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.runner.memory_budget import kv_budget_bytes

GiB = 1 << 30


def test_budget_is_what_utilization_leaves():
    assert kv_budget_bytes(80 * GiB, 0.9, 20 * GiB, GiB) == int(72 * GiB) - 21 * GiB
    assert kv_budget_bytes(80 * GiB, 0.5, 50 * GiB, 0) == 0  # never negative
    with pytest.raises(ValueError):
        kv_budget_bytes(80 * GiB, 1.5, 0, 0)


def test_profile_step_runs(tiny_engine_factory):
    engine = tiny_engine_factory("llama", max_num_batched_tokens=64)
    engine.runner.profile_step(64, 8)  # a 64-token prompt, 8 sampling rows: no error
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_cpu_default_is_one_gib(tiny_model_dir):
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine
    from kvserve.engine.runner.memory_budget import DEFAULT_CPU_KV_BYTES

    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama")), device="cpu"))
    per_block = engine.kv_format.bytes_per_block(engine.model_config, 16)
    assert engine.scheduler.kv.num_blocks == DEFAULT_CPU_KV_BYTES // per_block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures GPU memory")
def test_cuda_cache_fills_the_utilization(tiny_model_dir):
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama")), device="cuda",
                                 gpu_memory_utilization=0.05, enforce_eager=True))
    total = torch.cuda.mem_get_info()[1]
    used = torch.cuda.memory_allocated()
    assert 0.03 * total < used <= 0.05 * total
    assert engine.scheduler.kv.num_blocks > 1000
