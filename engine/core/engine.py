"""The engine: schedule -> run -> update, one step at a time, on the calling thread."""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.build import build_engine
from kvserve.engine.core.reports import EngineInfo, EngineSnapshot, EngineStats
from kvserve.engine.core.request_checks import check_request
from kvserve.engine.lora.manager import adapter_names, lora_key
from kvserve.engine.lora.runtime import RuntimeAdapters
from kvserve.engine.platform.outputs import RequestOutput, RequestTimes
from kvserve.engine.runner.step_batch import LaunchedStep
from kvserve.engine.sampling import StepResult
from kvserve.scheduler.output import SchedulerOutput
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams

log = logging.getLogger("kvserve.engine")


@dataclass
class InFlight:
    """A step launched on the device, its results not read yet."""
    out: SchedulerOutput
    launched: LaunchedStep


@dataclass
class StepCounters:
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt KV actually computed (prefix hits excluded)
    generated_tokens: int = 0


class Engine(RuntimeAdapters):
    """Its parts are built by engine/core/build.py; the engine runs them, one step at a time."""

    def __init__(self, config: EngineConfig, tokenizer=None):
        parts = build_engine(config, tokenizer)
        ctx = self.context = parts.context
        # The context's facts, which everyone holding an engine reads.
        self.config, self.model_config = ctx.config, ctx.model_config
        self.device, self.dtype, self.kv_format = ctx.device, ctx.dtype, ctx.kv_format
        self.tokenizer, self.eos_token_ids = ctx.tokenizer, ctx.eos_token_ids
        self.max_model_len = ctx.max_model_len
        self.runner, self.scheduler, self.speculator = (parts.runner, parts.scheduler,
                                                        parts.speculator)
        self.tp, self.lora, self.grammars = parts.tp, parts.lora, parts.grammars
        self.pipeline = parts.pipeline
        self.kv_events = parts.kv_events
        self.counters = StepCounters()
        self._inflight: InFlight | None = None  # async scheduling's running step
        self._staged: deque[InFlight] = deque()  # pipeline stages' steps, oldest first

    # -- what it tells its driver ------------------------------------------------
    def info(self) -> EngineInfo:
        mc, lora = self.model_config, self.lora
        return EngineInfo(max_model_len=self.max_model_len, vocab_size=mc.vocab_size,
                          structured_backend=self.config.structured_outputs_backend,
                          hidden_size=mc.hidden_size,
                          shorter_embeddings=mc.shorter_embeddings,
                          adapters=lora.names if lora is not None else None,
                          max_loras=lora.config.max_loras if lora is not None else 0,
                          warming_up=self.runner.warming_up,
                          eos_token_ids=tuple(self.eos_token_ids))

    def stats(self) -> EngineStats:
        """Counters since start and the queues now; the grammar compiles that ended
        since the previous call."""
        sched, counters = self.scheduler.stats(), self.counters
        # Only with LoRA on: the held grammars are not walked every step otherwise.
        running, waiting = (self.adapters_in_use(sched) if self.lora is not None
                            else ((), ()))
        return EngineStats(
            steps=counters.steps, prompt_tokens_computed=counters.prompt_tokens_computed,
            generated_tokens=counters.generated_tokens,
            prefix_queries=sched.prefix_queries, prefix_hits=sched.prefix_hits,
            tier_hits=sched.tier_hits,
            num_preemptions=sched.num_preemptions,
            spec=self.speculator.stats.copy() if self.speculator is not None else None,
            num_waiting=sched.num_waiting, num_running=sched.num_running,
            kv_usage=sched.kv_usage, lora_running=adapter_names(running),
            lora_waiting=adapter_names(waiting),
            grammar_compile_seconds=tuple(self.grammars.compiler.take_compile_seconds())
            if self.grammars is not None else (),
            warming_up=self.runner.warming_up)

    def snapshot(self) -> EngineSnapshot:
        """The queues request by request, for the engine page."""
        return EngineSnapshot(self.scheduler.snapshot(), self.speculator is not None,
                              time.monotonic())

    def close(self) -> None:
        """Stops the other tensor-parallel ranks and the KV event publisher, if any
        (the engine runs no more)."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def publish_kv_events(self) -> None:
        """What entered and left the prefix cache since the last call, to the KV
        event subscribers (--kv-events-config)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.take_kv_events())

    def on_rank_death(self, callback) -> None:
        """callback(why), on another thread, when a tensor-parallel rank or a
        pipeline stage dies."""
        for group in (self.tp, self.pipeline):
            if group is not None:
                group.on_death(callback)

    # -- requests --------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    cache_salt: str | None = None, priority: int = 0,
                    lora_name: str | None = None, background: bool = False) -> None:
        """Raises ValueError for a request that can never run. lora_name: the
        adapter it runs under (None: the base model); background: a batch job's line,
        scheduled after every interactive request (scheduler/waiting_queue.py)."""
        self.validate(prompt_token_ids, params)
        lora = lora_key(self.lora, lora_name)
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids,
                      arrival_time, cache_salt, priority, lora, background)
        req.make_siblings()
        if params.structured is None:
            self.scheduler.add_request(req)
        elif self.grammars is None:
            raise ValueError("structured outputs need the model's tokenizer, and this "
                             "model has none")
        else:  # enters the scheduler once its grammar is compiled
            self.grammars.hold(req)

    def validate(self, prompt_token_ids: list[int],
                 params: SamplingParams | None = None) -> None:
        """Raises ValueError for a prompt (or sampling parameters: token ids in
        logit_bias, allowed_token_ids or bad words) this engine can never run."""
        check_request(prompt_token_ids, params, self.max_model_len,
                      self.model_config.vocab_size)

    def abort_request(self, request_id: str, index: int | None = None,
                      reason: str = "abort") -> list[RequestOutput]:
        """Ends the request's sequences, or only the one at `index`; [] if unknown."""
        held = self.grammars.drop(request_id) if self.grammars is not None else None
        if held is not None:  # still waiting for its grammar: all of it ends
            return [self._output(self._ended(q, reason), [])
                    for q in (held, *held.pending_forks)]
        return [self._output(req, [])
                for req in self.scheduler.abort_request(request_id, index, reason)]

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self._inflight is not None
                or bool(self._staged) or bool(self.grammars))

    @staticmethod
    def _ended(req: Request, reason: str) -> Request:
        req.finish(reason)
        return req

    def _admit_compiled(self) -> list[RequestOutput]:
        """Constrained requests whose grammar is ready go to the scheduler; one refused
        (its grammar failed, or passed its deadline: gate.py) ends with finish reason
        "error". An engine with nothing but grammars compiling waits for one instead."""
        if not self.scheduler.has_unfinished() and self._inflight is None \
                and not self._staged:
            self.grammars.wait(timeout=0.05)
        admitted, failed = self.grammars.ready()
        for req in admitted:
            self.scheduler.add_request(req)
        return [replace(self._output(self._ended(q, "error"), []), finish_reason="error",
                        error=refusal.reason, error_status=refusal.status)
                for req, refusal in failed for q in (req, *req.pending_forks)]

    # -- the loop body -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches a step, and returns the outputs of the step that
        completed: this one, or under async scheduling the one before it (the new
        step already took that one's tokens as its input, on the device)."""
        outputs, previous = [], self._inflight
        self._retire_adapters()
        if self.grammars:
            outputs += self._admit_compiled()
        if self.pipeline is not None:
            return outputs + self._step_staged()
        if previous is not None and not self._can_overlap(previous.out):
            outputs, previous = outputs + self._complete(previous), None
        out = self.scheduler.schedule()
        launched = None
        if not out.is_empty:
            launched = InFlight(out, self.runner.launch(
                out, previous.launched if previous is not None else None))
            if launched.launched.failed:
                # Before anyone can hit the blocks its failed requests never wrote.
                self.scheduler.withdraw_unwritten(out, launched.launched.failed)
        if previous is not None:
            outputs += self._complete(previous)
        if launched is not None and not self.config.async_scheduling:
            outputs += self._complete(launched)
            launched = None
        self._inflight = launched
        return outputs

    def _step_staged(self) -> list[RequestOutput]:
        """Pipeline stages: launches a step while fewer than P are in flight, and
        completes the oldest once P are, or when no new step could start (its
        requests are all waiting for tokens in flight)."""
        staged = self._staged
        out = self.scheduler.schedule() if len(staged) < self.pipeline.steps_in_flight \
            else None
        if out is not None and not out.is_empty:
            launched = InFlight(out, self.runner.launch(out))
            if launched.launched.failed:
                self.scheduler.withdraw_unwritten(out, launched.launched.failed)
            staged.append(launched)
        if staged and (out is None or out.is_empty
                       or len(staged) == self.pipeline.steps_in_flight):
            return self._complete(staged.popleft())
        return []

    @staticmethod
    def _can_overlap(out: SchedulerOutput) -> bool:
        """May the next step be planned before this one's tokens reach the host?
        Not if it must see them there first: a parent forking its siblings, prompt
        logprobs in progress, or a request whose next token's logits processing
        reads its history: penalties, bad words of more than one token, or
        min_tokens not yet reached (the count decides whether stop tokens are
        banned). Logprobs, logit_bias and allowed_token_ids need
        nothing from the host, and a grammar mask takes the tokens it needs when
        the next step samples (Sampler._catch_up), after its forward pass."""
        for s in out.scheduled:
            req = s.request
            if req.needs_prompt_logits:
                return False
            params = req.params
            if s.samples and params.needs_processing and (
                    params.has_penalties or req.num_output_tokens < params.min_tokens
                    or (params.bad_words is not None and params.bad_words.reads_output)):
                return False
            if s.samples and req.pending_forks:
                return False
        return True

    def _complete(self, step: InFlight) -> list[RequestOutput]:
        """Reads a launched step's tokens and hands them to the scheduler."""
        out = step.out
        result = self.runner.finish(step.launched)
        self._count(out, result.tokens)
        # Before update: it then skips the failed requests as finished.
        failed = self._fail(out, result.failed)
        changed = self.scheduler.update(out, result.tokens)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        outputs = [self._output(req, _new_tokens(req, result), result) for req in changed]
        # What reached the requests: not a token sampled for one that had ended
        # (aborted, or stopped) while its step ran.
        self.counters.generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        return failed + outputs

    def _fail(self, out: SchedulerOutput, failed: dict[str, str]) -> list[RequestOutput]:
        """Ends the requests the step failed for: finish reason "error", the reason
        kept for the front end."""
        ended = self.scheduler.fail_requests(out, failed)
        for req, why in ended:
            if req.request_id in failed:  # not its siblings still to fork
                log.error("request %s failed: %s", req.request_id, why)
        return [replace(self._output(r, []), finish_reason="error", error=why)
                for r, why in ended]

    def _count(self, out, tokens: dict[str, int | list[int]]) -> None:
        self.counters.steps += 1
        if self.speculator is not None:
            verified = [s for s in out.scheduled if s.spec_token_ids
                        and s.request.request_id in tokens]
            self.speculator.stats.record(
                [len(s.spec_token_ids) for s in verified],
                [len(tokens[s.request.request_id]) - 1 for s in verified])
        for s in out.scheduled:
            prompt_left = s.request.num_prompt_tokens - s.start
            self.counters.prompt_tokens_computed += max(0, min(s.num_new_tokens, prompt_left))

    def _output(self, req: Request, new_tokens: list[int],
                result: StepResult | None = None) -> RequestOutput:
        rid = req.request_id
        if req.finished:
            self.runner.release(rid)
            if self.speculator is not None:
                self.speculator.release(rid)
        # One per new token for a request that asked ([] for an abort); else None.
        logprobs = [] if req.params.logprobs is not None else None
        prompt_logprobs = None
        if result is not None:
            if rid in result.logprobs:
                logprobs.append(result.logprobs[rid])
            prompt_logprobs = result.prompt_logprobs.get(rid)
        return RequestOutput(
            request_id=req.group_id, index=req.index, new_token_ids=new_tokens,
            finished=req.finished,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            times=RequestTimes.of(req) if req.finished else None,
            embedding=result.embeddings.get(rid) if result is not None else None)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[int]]:
        """Offline helper: run prompts to completion, return generated token ids
        (for n > 1, the n sequences of each prompt one after another)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        tag = time.monotonic_ns()
        keys = [(f"offline-{tag}-{i}", j) for i, p in enumerate(plist) for j in range(p.n)]
        results: dict[tuple[str, int], list[int]] = {k: [] for k in keys}
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            self.add_request(f"offline-{tag}-{i}", prompt, p)
        while self.has_unfinished_requests():
            for o in self.step():
                results[(o.request_id, o.index)].extend(o.new_token_ids)
        return [results[k] for k in keys]


def _new_tokens(req: Request, result: StepResult) -> list[int]:
    """What the step added to req: one token, or a verification's accepted drafts
    and the token after them (cut by the scheduler where one finished it)."""
    tokens = result.tokens.get(req.request_id)
    return tokens if isinstance(tokens, list) else [req.token_ids[-1]]
