"""Start the engine the server talks to: on a thread of this process, or in a process
of its own. `auto` picks the process on CUDA, where a decode step is short enough
that the front end's per-token work would otherwise stretch it (measured in
bench/frontend_wait.py), and the thread on CPU, where a step is long and a second
process would only compete for the same few cores."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.client.engine_client import EngineClient

ENGINE_MODES = ("auto", "thread", "process")


def pick_mode(mode: str, config: EngineConfig) -> str:
    if mode not in ENGINE_MODES:
        raise ValueError(f"engine mode must be one of {ENGINE_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    from engine.loader import resolve_device

    return "process" if resolve_device(config.device).type == "cuda" else "thread"


def start_engine(config: EngineConfig, mode: str = "auto") -> EngineClient:
    """Loads the model (in whichever place) and returns its client, not yet started.
    Raises what loading raises (ModelLoadError, ModelConfigError, EngineStartError...)."""
    if pick_mode(mode, config) == "thread":
        from engine.client.async_engine import AsyncEngine
        from engine.engine import Engine

        return AsyncEngine(Engine(config))
    from modelstore.tokenizer import has_tokenizer, load_tokenizer
    from engine.client.process_engine import ProcessEngine

    tokenizer = load_tokenizer(config.model) if has_tokenizer(config.model) else None
    return ProcessEngine(config, tokenizer)
