"""Drive prompts through the engine and turn their token streams into text deltas.

Both /v1/completions and /v1/chat/completions run on this: a request is one or more
PromptGroups, each one engine request with n sequences (sharing the prompt's KV
blocks), and each sequence has its own incremental detokenizer. What comes out is a
stream of ChoiceDeltas: text that is final, with the logprobs of the tokens behind it."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from kvserve.engine.client.engine_client import EngineClient, EngineDeadError
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.server.detokenizer import IncrementalDetokenizer
from kvserve.server.errors import APIError
from kvserve.server.metrics.frontend import current_clock
from kvserve.server.tracing import watch_group

log = logging.getLogger("kvserve.server")


class RequestFailedError(RuntimeError):
    """The engine ended a sequence with finish reason "error" (an exception or NaN/inf
    logits for that request alone): the request gets a 500, everyone else goes on."""


# What status_of answers with its own status and message (an expected end, not a bug).
EXPECTED_ERRORS = (ValueError, EngineDeadError, RequestFailedError, APIError)


@dataclass
class PromptGroup:
    """One prompt and its n sequences. Choice indices are prompt_index * n + sequence."""
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # the prompt as the client sent it, when text
    count_output: bool = True  # False: echo of the prompt only, its token not counted
    grammar_param: str | None = None  # the field its grammar came in (tools, response_format...)

    def choice_index(self, seq_index: int) -> int:
        return self.index * self.params.n + seq_index


@dataclass
class TextOptions:
    """How tokens become text: stop strings and special tokens."""
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0
    timeout: float = 0.0  # --request-timeout: seconds, 0: none
    lora_name: str | None = None  # the LoRA adapter the request asked for as its model
    background: bool = False  # a batch job's line (server/background.py)


@dataclass
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0  # tokens generated so far for this choice
    logprobs: list = field(default_factory=list)  # engine TokenLogprobs behind `text`
    token_ids: list[int] = field(default_factory=list)  # the tokens behind `text`
    prompt_logprobs: list | None = None  # on a choice's first delta, when asked for
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first: bool = False  # the choice's first delta
    # A prefill instance's hand-off to the decode one (engine/kv_transfer/), on the
    # finishing delta of choice 0 when the request asked for do_remote_decode.
    kv_transfer_params: dict | None = None


class _Sequence:
    """One of a prompt's n sequences on its way to text."""

    def __init__(self, tokenizer, group: PromptGroup, opts: TextOptions):
        self.detok = IncrementalDetokenizer(tokenizer, group.prompt_ids, opts.stop,
                                            opts.include_stop_str_in_output,
                                            opts.skip_special_tokens)
        self.include_stop = opts.include_stop_str_in_output
        # Without a tokenizer there is no text to wait for: every output is a delta.
        self.text_gates = tokenizer is not None
        self.num_tokens = 0
        self.pending_logprobs: list = []  # tokens whose text is still held back
        self.pending_ids: list[int] = []
        self.prompt_logprobs = None
        self.started = False
        self.done = False

    def advance(self, out) -> ChoiceDelta | None:
        """Feed one engine output; the delta that is now final, if any."""
        self.num_tokens += len(out.new_token_ids)
        self.pending_logprobs.extend(out.logprobs or ())
        self.pending_ids.extend(out.new_token_ids)
        if getattr(out, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = out.prompt_logprobs
        new = out.new_token_ids
        if out.finish_reason == "stop" and not self.include_stop:
            new = new[:-1]  # as in vLLM, the EOS / stop token's text is left out
        self.detok.add_tokens(new)
        if self.detok.stop_reason is not None:
            delta = ChoiceDelta(0, self.detok.flush(True), "stop", self.detok.stop_reason)
        else:
            finish = out.finish_reason if out.finished else None
            delta = ChoiceDelta(0, self.detok.flush(out.finished), finish, out.stop_reason)
            if self.text_gates and not (delta.text or finish):
                return None  # nothing final yet: its logprobs wait for the text
        return self._fill(delta, out)

    def _fill(self, delta: ChoiceDelta, out) -> ChoiceDelta:
        delta.num_tokens, delta.first = self.num_tokens, not self.started
        delta.logprobs, self.pending_logprobs = self.pending_logprobs, []
        delta.token_ids, self.pending_ids = self.pending_ids, []
        delta.num_prompt_tokens, delta.num_cached_tokens = (out.num_prompt_tokens,
                                                            out.num_cached_tokens)
        if not self.started:
            delta.prompt_logprobs = self.prompt_logprobs
        delta.kv_transfer_params = getattr(out, "kv_transfer_params", None)
        self.started = True
        self.done = delta.finish_reason is not None
        return delta


Emit = Callable[[ChoiceDelta], Awaitable[None]]


async def run_group(engine: EngineClient, base_id: str, group: PromptGroup,
                    opts: TextOptions, emit: Emit) -> None:
    """Drive one prompt's n sequences to the end, calling emit(delta) as text becomes
    final. A stop string ends its sequence early (aborted in the engine); leaving
    early aborts whatever still runs. base_id: the request's engine id
    (server/request_owners.engine_request_id)."""
    seqs = [_Sequence(engine.tokenizer, group, opts) for _ in range(group.params.n)]
    engine_id = f"{base_id}-{group.index}"
    gen = engine.generate(engine_id, group.prompt_ids, group.params,
                          cache_salt=opts.cache_salt, priority=opts.priority,
                          lora_name=opts.lora_name, background=opts.background)
    gen, emit = watch_group(base_id, group, opts, gen, emit)  # --otlp-traces-endpoint
    async with contextlib.aclosing(gen):
        with _deadline(engine, engine_id, opts.timeout):
            await _relay(engine, gen, seqs, group, emit)


async def _relay(engine: EngineClient, gen, seqs: list[_Sequence], group: PromptGroup,
                 emit: Emit) -> None:
    async for out in gen:
        seq = seqs[out.index]
        if seq.done:
            continue  # the abort that follows a stop string
        if out.finish_reason == "error":  # leaving aborts the prompt's other sequences
            if out.error_status is not None:  # the request's own doing (its grammar)
                param = group.grammar_param
                raise APIError(out.error_status, f"{param}: {out.error}" if param
                               else out.error or "refused", param)
            raise RequestFailedError(out.error or "the engine failed this request")
        delta = seq.advance(out)
        if delta is None:
            continue
        delta.index = group.choice_index(out.index)
        if seq.done and not out.finished:
            engine.abort(out.request_id, out.index, reason="stop")
        await emit(delta)


@contextlib.contextmanager
def _deadline(engine: EngineClient, engine_id: str, timeout: float):
    """Past `timeout` seconds, aborts the engine request's n sequences. As in vLLM,
    an abort is an ordinary end: each choice finishes with reason "abort" and keeps
    the text made so far (none, if it never got scheduled), and blocks are freed."""
    if not timeout:
        yield
        return
    def expire():
        log.info("request %s ran past --request-timeout (%gs): aborted", engine_id, timeout)
        engine.abort(engine_id)

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        yield
    finally:
        timer.cancel()


async def collect(engine: EngineClient, base_id: str, groups: list[PromptGroup],
                  opts: TextOptions) -> dict[int, list[ChoiceDelta]]:
    """Every choice's deltas, in order, once all are finished."""
    results: dict[int, list[ChoiceDelta]] = {}
    clock = current_clock()

    async def keep(d: ChoiceDelta):
        results.setdefault(d.index, []).append(d)
        # Ready to send: timing the body's one write instead would make every
        # token's latency the whole request's (vLLM times it here too).
        clock.sent((d,))

    await gather_or_fail([asyncio.create_task(run_group(engine, base_id, g, opts, keep))
                          for g in groups])
    return results


async def gather_or_fail(tasks: list[asyncio.Task]) -> list:
    """The tasks' results; a failure ends the others, and an expected one (a refused
    request, a dead engine) becomes its APIError (status_of)."""
    try:
        return await asyncio.gather(*tasks)
    except APIError:
        raise
    except EXPECTED_ERRORS as exc:
        raise APIError(*status_of(exc)) from exc
    finally:
        for t in tasks:
            t.cancel()


async def stream(engine: EngineClient, base_id: str, groups: list[PromptGroup],
                 opts: TextOptions) -> AsyncIterator[list[ChoiceDelta | APIError]]:
    """Deltas of all choices as they come, in batches of whatever is ready, so a
    front end that fell behind the engine catches up with one write per batch. An
    error ends the stream as an APIError item (the HTTP status is already sent).
    Closing it aborts what still runs."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(group: PromptGroup):
        try:
            await run_group(engine, base_id, group, opts, queue.put)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if not isinstance(exc, EXPECTED_ERRORS):
                log.error("internal error in a streaming request", exc_info=exc)
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(g)) for g in groups]
    running = len(groups)
    try:
        while running:
            batch = []
            for item in _ready(await queue.get(), queue):
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    yield batch + [APIError(*status_of(item))]
                    return
                else:
                    batch.append(item)
            if batch:
                yield batch
    finally:
        for t in tasks:  # a client that went away: abort whatever still runs
            t.cancel()


def _ready(first, queue: asyncio.Queue):
    yield first
    while not queue.empty():
        yield queue.get_nowait()


def status_of(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, APIError):
        return exc.status, exc.message
    if isinstance(exc, ValueError):
        return 400, str(exc)
    if isinstance(exc, EngineDeadError):
        return 503, str(exc)
    if isinstance(exc, RequestFailedError):  # the engine logged it, with the request id
        return 500, f"the engine failed this request: {exc}"
    return 500, f"internal error: {type(exc).__name__}"


def usage(groups: list[PromptGroup], deltas: dict[int, ChoiceDelta]) -> dict:
    """deltas: the last delta of every choice."""
    prompt_tokens = sum(len(g.prompt_ids) for g in groups)
    counted = {i for g in groups if g.count_output
               for i in range(g.choice_index(0), g.choice_index(g.params.n))}
    completion_tokens = sum(d.num_tokens for i, d in deltas.items() if i in counted)
    cached = {}
    for g in groups:  # one figure per prompt, from any of its choices
        d = next((deltas[i] for i in range(g.choice_index(0), g.choice_index(g.params.n))
                  if i in deltas), None)
        cached[g.index] = d.num_cached_tokens if d else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
