"""The engine: schedule -> run -> update, one step at a time, on the calling thread."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from kvserve.engine.attention import make_backend
from kvserve.engine.compiled_model import use_cache_dir
from kvserve.engine.cpu_kernels.build import c_compiler
from kvserve.engine.config import EngineConfig, ModelConfig
from kvserve.engine.cuda_graphs import DecodeGraphPlan
from kvserve.engine.lora.manager import LoRAManager, lora_key
from kvserve.engine.lora.runtime import RuntimeAdapters
from kvserve.engine.loader import resolve_device, resolve_dtype
from kvserve.engine.memory_budget import log_kv_cache, num_kv_blocks
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.step_batch import LaunchedStep
from kvserve.engine.model_setup import load_served_model
from kvserve.engine.kv_events.publisher import make_publisher
from kvserve.engine.parallel import comm
from kvserve.engine.parallel.group import start_group
from kvserve.engine.outputs import RequestOutput, RequestTimes
from kvserve.engine.request_checks import check_request
from kvserve.engine.sampling import StepResult
from kvserve.engine.spec_decode.setup import make_drafter, make_speculator
from kvserve.engine.structured.gate import GrammarGate
from kvserve.engine.structured.compiler import GrammarCompiler
from kvserve.engine.structured.matchers import Matchers
from kvserve.scheduler.output import SchedulerOutput
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.modelstore.default_model import cache_root
from kvserve.modelstore.tokenizer import has_tokenizer, load_tokenizer
from kvserve.scheduler.config import KVCacheConfig, SchedulerConfig
from kvserve.scheduler.scheduler import Scheduler

log = logging.getLogger("kvserve.engine")


@dataclass
class InFlight:
    """A step launched on the device, its results not read yet."""
    out: SchedulerOutput
    launched: LaunchedStep


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt KV actually computed (prefix hits excluded)
    generated_tokens: int = 0


class Engine(RuntimeAdapters):
    def __init__(self, config: EngineConfig, tokenizer=None):
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        cfg = self.model_config
        self.max_model_len = min(config.max_model_len or cfg.max_model_len, cfg.max_model_len)
        # A preset or a config-only directory has no tokenizer: the engine then takes
        # and returns token ids only, and stops on the config's eos ids.
        if tokenizer is None and has_tokenizer(config.model):
            tokenizer = load_tokenizer(config.model)
        self.tokenizer = tokenizer
        if tokenizer is None:
            log.info("%s has no tokenizer: token ids only", config.model)
        self.eos_token_ids = self._eos_ids()
        torch.manual_seed(config.seed)
        # Tensor parallelism: the other ranks start loading their parts beside ours.
        self.tp = start_group(config, cfg, self.device, self.dtype, self.max_model_len)
        model, self.kv_format = load_served_model(config, cfg, tokenizer, self.device,
                                                  self.dtype, self.max_model_len,
                                                  comm.shard())
        # Before the KV cache is sized: the adapter slots' memory is not the cache's.
        self.lora = (LoRAManager(config.lora, cfg, self.device, self.dtype)
                     if config.lora is not None else None)
        kv_cfg = comm.shard().kv_view(cfg)  # the KV heads this process's cache holds
        num_blocks = num_kv_blocks(config, kv_cfg, model, self.device, self.dtype, self.kv_format)
        # A request longer than the whole cache could never run.
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        if self.tp is not None:
            self.tp.share_num_blocks(num_blocks)
        backend = make_backend(config.attention_backend, self.device, config.block_size,
                               self.dtype, self.kv_format.dtype)
        t0 = time.perf_counter()
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.device,
                                  self.kv_format, backend,
                                  make_drafter(self, model, backend, num_blocks),
                                  self._decode_graph_plan(backend), self.lora,
                                  self.tp.channel if self.tp is not None else None)
        if self.runner.decode_graphs is not None:
            log.info("captured CUDA graphs for decode batch sizes %s in %.1f s",
                     self.runner.decode_graphs.buckets, time.perf_counter() - t0)
        self._compile_forward()
        self.grammars = self._grammar_gate()
        self.kv_events = make_publisher(config.kv_events_config)
        self.scheduler = Scheduler.with_kv_cache(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, policy=config.scheduling_policy,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_loras=config.lora.max_loras if config.lora is not None else 0),
            KVCacheConfig(num_blocks, config.block_size, config.enable_prefix_caching,
                          model_key=str(config.model), kv_events=self.kv_events is not None))
        self.stats = EngineStats()
        self.speculator = make_speculator(config)
        self._inflight: InFlight | None = None  # async scheduling's running step
        if config.async_scheduling and self.device.type != "cuda":
            log.warning("async scheduling on %s overlaps nothing (the forward pass runs "
                        "on the host) and reports each step one step later",
                        self.device.type)
        log_kv_cache(num_blocks, config.block_size, self.kv_format, kv_cfg, self.max_model_len)

    def _decode_graph_plan(self, backend) -> DecodeGraphPlan | None:
        """CUDA graphs for decode-only steps, on CUDA unless --enforce-eager."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.tp is not None:
            return None  # (tensor parallel steps stay eager until measured on GPUs)
        if not backend.graph_safe:
            log.info("CUDA graphs off: the %s attention backend cannot be captured",
                     backend.name)
            return None
        return DecodeGraphPlan(self.config.max_num_seqs, self.max_model_len)

    def _grammar_gate(self) -> GrammarGate | None:
        """Structured outputs, where there is a tokenizer to build grammars over."""
        if self.tokenizer is None:
            return None
        vocab, cfg = self.model_config.vocab_size, self.config
        matchers = Matchers(vocab)
        self.runner.sampler.matchers = matchers
        return GrammarGate(GrammarCompiler(
            self.tokenizer, vocab, list(self.eos_token_ids), cfg.structured_outputs_backend,
            cfg.grammar_compile_timeout, cfg.grammar_cache_bytes), matchers)

    def _compile_forward(self) -> None:
        """The Inductor-compiled forward pass, as `compile` and --enforce-eager say."""
        mode = "off" if self.config.enforce_eager or self.tp is not None else self.config.compile
        if mode == "auto":
            mode = "off" if self.device.type == "cuda" else "background"
        if mode == "off":
            return
        if self.device.type == "cpu" and self.runner.attn_backend.name != "torch":
            # Triton's interpreter (a test vehicle on CPU) reads raw pointers that
            # Inductor's graphs do not promise it, and it is slower than any graph.
            log.info("forward pass not compiled: the %s attention backend runs in "
                     "Triton's interpreter on CPU", self.runner.attn_backend.name)
            return
        if c_compiler() is None:
            log.warning("no C++ compiler found (g++ or $CXX): the forward pass stays "
                        "eager, several times slower on CPU; install one (apt-get "
                        "install g++) or pass --enforce-eager to silence this")
            return
        use_cache_dir(str(cache_root()))
        self.runner.compile_forward(background=mode == "background")

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def close(self) -> None:
        """Stops the other tensor-parallel ranks and the KV event publisher, if any
        (the engine runs no more)."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def publish_kv_events(self) -> None:
        """What entered and left the prefix cache since the last call, to the KV
        event subscribers (--kv-events-config)."""
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.take_kv_events())

    def on_rank_death(self, callback) -> None:
        """callback(why), on another thread, when a tensor-parallel rank dies."""
        if self.tp is not None:
            self.tp.on_death(callback)

    # -- requests --------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    cache_salt: str | None = None, priority: int = 0,
                    lora_name: str | None = None) -> None:
        """Raises ValueError for a request that can never run. lora_name: the
        adapter it runs under (None: the base model)."""
        self.validate(prompt_token_ids, params)
        lora = lora_key(self.lora, lora_name)
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids,
                      arrival_time, cache_salt, priority, lora)
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
        logit_bias) this engine can never run."""
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
                or bool(self.grammars))

    @staticmethod
    def _ended(req: Request, reason: str) -> Request:
        req.finish(reason)
        return req

    def _admit_compiled(self) -> list[RequestOutput]:
        """Constrained requests whose grammar is ready go to the scheduler; one refused
        (its grammar failed, or passed its deadline: gate.py) ends with finish reason
        "error". An engine with nothing but grammars compiling waits for one instead."""
        if not self.scheduler.has_unfinished() and self._inflight is None:
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

    @staticmethod
    def _can_overlap(out: SchedulerOutput) -> bool:
        """May the next step be planned before this one's tokens reach the host?
        Not if it must see them there first: a parent forking its siblings, prompt
        logprobs in progress, or a request whose next token's logits processing
        reads its history: penalties, or min_tokens not yet reached (the count
        decides whether stop tokens are banned). Logprobs and logit_bias need
        nothing from the host, and a grammar mask takes the tokens it needs when
        the next step samples (Sampler._catch_up), after its forward pass."""
        for s in out.scheduled:
            req = s.request
            if req.needs_prompt_logits:
                return False
            params = req.params
            if s.samples and params.needs_processing and (
                    params.has_penalties or req.num_output_tokens < params.min_tokens):
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
        self.stats.generated_tokens += sum(len(o.new_token_ids) for o in outputs)
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
        self.stats.steps += 1
        if self.speculator is not None:
            verified = [s for s in out.scheduled if s.spec_token_ids
                        and s.request.request_id in tokens]
            self.speculator.stats.record(
                [len(s.spec_token_ids) for s in verified],
                [len(tokens[s.request.request_id]) - 1 for s in verified])
        for s in out.scheduled:
            prompt_left = s.request.num_prompt_tokens - s.start
            self.stats.prompt_tokens_computed += max(0, min(s.num_new_tokens, prompt_left))

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
