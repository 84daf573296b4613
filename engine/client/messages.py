"""What crosses between the server and the engine loop, typed both ways: one small
record per command down; up, EngineReady (or EngineDied) once the engine is built,
then one StepReport per loop iteration, and EngineDied if it stops. The same records
travel a thread's queue (AsyncEngine) and a process's pipe (ProcessEngine), so they
are plain, picklable and slotted (a step's report is unpickled on the server's event
loop every step)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.core.reports import EngineInfo, EngineSnapshot
from kvserve.engine.platform.outputs import RequestOutput
from kvserve.engine.spec_decode.speculator import SpecDecodeStats
from kvserve.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # params.n sequences, reported as (request_id, index)
    cache_salt: str | None = None
    priority: int = 0
    lora_name: str | None = None  # the LoRA adapter it runs under; None: the base model
    background: bool = False  # a batch job's line: after interactive requests


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str
    index: int | None = None  # one of its n sequences; None: all of them
    reason: str = "abort"  # "stop": the front end found a stop string (counted so)


@dataclass(frozen=True, slots=True)
class ChangeAdapter:
    """Loads (path given) or unloads (path None) a LoRA adapter; answered in a
    report's adapter_replies under op_id."""
    op_id: int
    name: str
    path: str | None = None
    replace: bool = False  # a load may take the name of a loaded adapter


@dataclass(frozen=True, slots=True)
class AdapterReply:
    op_id: int
    error: str | None = None  # None: done
    not_found: bool = False  # the error is an unknown adapter (a 404)


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class TakeSnapshot:
    """Asks for an EngineSnapshot in the next report: sent a few times a second while
    someone watches the engine page, never otherwise."""


EngineCommand = AddRequest | AbortRequest | ChangeAdapter | Shutdown | TakeSnapshot


@dataclass(frozen=True, slots=True)
class EngineReady:
    """The engine is built and takes commands."""
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class EngineDied:
    """The engine could not be built, or stopped for good (a crash, a dead rank)."""
    reason: str


@dataclass(slots=True)
class StepReport:
    """What one loop iteration did, for the front end."""
    outputs: list[RequestOutput] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, why)
    added: int = 0  # adds taken off the command queue (accepted or rejected)
    prompt_tokens: int = 0  # prompt tokens of the accepted adds
    waiting: int = 0  # the scheduler's queue lengths after the iteration
    running: int = 0
    # The step, if one ran: when it started (time.monotonic, comparable across
    # processes), how long it took, and how many prompt tokens it computed.
    step_start: float | None = None
    step_seconds: float = 0.0
    prompt_tokens_computed: int = 0
    step_tokens: int = 0  # prompt tokens computed plus tokens sampled in the step
    # Engine counters since the previous report: deltas, so the receiver only adds
    # them up and no report is counted twice or lost between steps.
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    tier_hits: int = 0  # of those, tokens loaded back from the second KV tier
    preemptions: int = 0
    kv_usage: float = 0.0  # fraction of the KV cache's blocks in use, after it (0..1)
    spec: SpecDecodeStats | None = None  # speculative decoding's counts (deltas), if on
    constrained: int = 0  # accepted adds with a structured output
    grammar_compile_seconds: list[float] = field(default_factory=list)  # since last
    warming_up: bool = False  # steps still eager while the compiled graphs are built
    adapter_replies: list[AdapterReply] = field(default_factory=list)
    # With LoRA on: the adapters of running and of waiting requests (names, sorted).
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    snapshot: EngineSnapshot | None = None  # when a TakeSnapshot came in
