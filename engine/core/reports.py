"""What the engine tells whoever drives it, as plain picklable records: who it is
(EngineInfo, once, when it is ready), what it has done so far (EngineStats, a
snapshot taken whenever asked) and, for the engine page, its queues request by
request (EngineSnapshot). The engine loop turns two EngineStats into one report's
differences: nothing above the engine reads its parts."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.spec_decode.speculator import SpecDecodeStats
from kvserve.scheduler.snapshot import SchedulerSnapshot


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the front end needs of the engine it talks to."""
    max_model_len: int  # what the model, --max-model-len and the KV cache's size allow
    vocab_size: int
    structured_backend: str  # the front end checks grammar specs for it
    hidden_size: int = 0  # an embedding's length
    shorter_embeddings: tuple[int, ...] | None = None  # lengths it may be cut to
    adapters: dict[str, str] | None = None  # served LoRA name -> path; None: LoRA off
    max_loras: int = 0
    warming_up: bool = False  # as the engine started (reports say when it changes)
    # The tokens that end a sequence: the model config's eos_token_id and the
    # tokenizer's EOS (engine/core/build.py); beam search ends hypotheses at them.
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStats:
    # Running totals since start (never reset): the receiver takes differences.
    steps: int
    prompt_tokens_computed: int  # prompt KV actually computed (prefix hits excluded)
    generated_tokens: int  # tokens that reached requests
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found cached
    num_preemptions: int
    spec: SpecDecodeStats | None  # speculative decoding's counts, if it is on
    # As they are now.
    num_waiting: int
    num_running: int
    kv_usage: float  # fraction of the KV cache's blocks in use (0..1)
    lora_running: tuple[str, ...]  # adapters of running and of waiting requests (names)
    lora_waiting: tuple[str, ...]
    # Events since the previous snapshot: each is in exactly one.
    grammar_compile_seconds: tuple[float, ...]
    # Steps run eagerly while the compiled forward pass is built (ModelRunner).
    warming_up: bool = False
    tier_hits: int = 0  # of the prefix hits, tokens loaded back from the second KV tier


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    scheduler: SchedulerSnapshot
    speculative: bool  # drafts are proposed and verified: acceptance is worth showing
    taken_at: float  # time.monotonic(), comparable across processes
