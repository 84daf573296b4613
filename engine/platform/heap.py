"""The heap built at start-up (torch, transformers, the model's modules, the
tokenizer: ~230k objects in the front end alone) is moved out of the garbage
collector's sight once loaded: it lives as long as the process, and every full
collection walked all of it again.

Measured on the default model's server (2-core Zen 4): parsing one 5 MB request body
(20,000 tool definitions, whose 140k new dicts and lists set off collections) took
0.18-0.21 s with the start-up heap in the collector's generations and 0.05-0.09 s with
it frozen; a pause like that in the front end holds every stream's next token, in the
engine a step. vLLM's API server freezes its start-up heap the same way."""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collects what start-up left for garbage, then freezes the rest (gc.freeze: the
    objects alive now are never scanned again; new ones are collected as before)."""
    gc.collect()
    gc.freeze()
