"""Start the engine the server talks to: on a thread of this process, or in a process
of its own. `auto` picks the process, on CUDA and on CPU alike. A step that the
front end's per-token work shares a GIL with stretches by whole GIL switch intervals:
with the compiled forward pass, one client's CPU decode step is ~11 ms, and a
thread's inter-token latency was 30 ms against 11.6 ms in a process (default model,
bf16, 2 cores; the 16-client workload gave 169 vs 229 output tok/s). The thread stays
for tests and embedding."""
from __future__ import annotations

from kvserve.engine.client.engine_client import EngineClient
from kvserve.engine.config.engine_config import EngineConfig

ENGINE_MODES = ("auto", "thread", "process")


def pick_mode(mode: str) -> str:
    if mode not in ENGINE_MODES:
        raise ValueError(f"engine mode must be one of {ENGINE_MODES}, got {mode!r}")
    return "process" if mode == "auto" else mode


def start_engine(config: EngineConfig, mode: str = "auto") -> EngineClient:
    """Loads the model (in whichever place) and returns its client, not yet started.
    Raises what loading raises (ModelLoadError, ModelConfigError, EngineStartError...)."""
    if pick_mode(mode) == "thread":
        from kvserve.engine.client.async_engine import AsyncEngine
        from kvserve.engine.core.engine import Engine

        return AsyncEngine(Engine(config))
    from kvserve.modelstore.tokenizer import has_tokenizer, load_tokenizer
    from kvserve.engine.client.process_engine import ProcessEngine

    def tokenizer():
        return load_tokenizer(config.model) if has_tokenizer(config.model) else None

    return ProcessEngine(config, load_tokenizer=tokenizer)
