"""Grammars compiled over the vocabulary, one at a time, off the engine's thread, each
under a deadline (--grammar-compile-timeout), and given up when nobody waits for it.

Why a thread, and why it is abandoned rather than stopped. Neither library can stop
a compile: xgrammar's `compile_grammar` is one C++ call with no cancel hook or time
limit (it releases the GIL, so it costs the engine a core, not the interpreter).
Its cost follows the grammar's repetitions, not the spec's size: on SmolLM2's 49k
vocabulary (2 cores) a normal schema compiles in 0.1-0.25 s (bench/structured_schemas.py;
those without free strings in < 1 ms), 128 tools 0.06 s, 1000 choices 0.08 s, fifty
fields with lengths up to 206 characters 10.7 s, and one 400-byte schema of ten
strings of `maxLength` 3000 about 28 s (2.8 s per string, linearly); so small specs
can hold a compile for hours, and only a deadline bounds it. A subprocess could be
killed, but its grammar must come back, and xgrammar's only way out of a process is
its JSON serialisation: 163 MB, 6 s to write and 2.3 s to read back for 128 tools
that compile in 0.06 s (490 MB for the fifty fields); every compile would pay for the
trip more than for the work. So compiles run in this process, on one thread (the
"lane"); a job past its deadline, or whose requests have all gone (aborted, client
gone), is given up: its thread is left to finish at the lowest CPU priority (nice 19
on Linux: against a thread at the default priority it gets ~1.5% of a contended
core, so steps keep theirs) and a fresh lane takes the queue at once, so later
requests never wait behind it. At most MAX_ABANDONED given-up compiles run at once:
at that many no new lane starts until one of them ends, and a job still queued once
the compiler has been stalled for a deadline is refused as busy (503). What a
given-up compile still produces is kept in the cache (the work is done; the same spec
again is then free). Its memory is held until it ends: the caps on specs
(server/grammar_limits.py) bound the spec, not what its compile needs.

llguidance (--structured-outputs-backend guidance) builds its lexer lazily, bounded
by its own fuel limits (ParserLimits: ~20 ms to start, ~4 ms a step), so its
"compile" is cheap; it takes the same lane and deadline all the same."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import NamedTuple

import xgrammar as xgr

from kvserve.engine.config.engine_config import (DEFAULT_GRAMMAR_CACHE_BYTES,
                                                 DEFAULT_GRAMMAR_COMPILE_TIMEOUT)
from kvserve.engine.structured.grammar_cache import GrammarCache
from kvserve.engine.structured.grammars import Grammar, XgrammarGrammar, parse, uses_guidance
from kvserve.scheduler.structured_output import StructuredOutput

log = logging.getLogger("kvserve.structured")

MAX_ABANDONED = 2  # compiles given up on but still running, at most
LOWEST_PRIORITY = 19  # nice value of an abandoned compile's thread


class Refusal(NamedTuple):
    """Why a request's grammar will not come, and the HTTP status that is: 400 (the
    spec is the client's), 503 (the compiler is busy), None (ours: a 500)."""
    reason: str
    status: int | None


class CompileJob:
    """One spec's compile, shared by every request that waits for it."""

    def __init__(self, spec: StructuredOutput, submitted: float):
        self.spec = spec
        self.future: Future = Future()  # the Grammar, or what its compile raised
        self.submitted = submitted  # time.monotonic()
        self.started: float | None = None  # when a lane took it
        self.waiters = 1

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> Grammar:
        return self.future.result(timeout)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 backend: str = "xgrammar",
                 timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES):
        # The model's own end tokens end a grammar (the tokenizer's may differ).
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._xgrammar = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._backend, self._stops = backend, list(stop_token_ids)
        self._guidance_tokenizer = None
        if backend == "guidance":
            from kvserve.engine.structured.guidance import guidance_tokenizer
            self._guidance_tokenizer = guidance_tokenizer(tokenizer, vocab_size, self._stops)
        self.timeout = timeout  # 0: none
        self.cache = GrammarCache(cache_bytes)
        self._cond = threading.Condition()
        self._queue: deque[CompileJob] = deque()
        self._compiling: dict[StructuredOutput, CompileJob] = {}  # one job per spec
        self._lane: threading.Thread | None = None  # started at the first job
        self._running: CompileJob | None = None  # the lane's job
        self._abandoned = 0  # threads given up on, still compiling
        self._stalled_since: float | None = None  # jobs queued, no lane allowed
        self._compile_seconds: list[float] = []  # since take_compile_seconds

    def submit(self, spec: StructuredOutput) -> CompileJob:
        """The spec's job: done at once if cached; else queued, or the job already
        under way for the same spec (its requests share it)."""
        with self._cond:
            now = time.monotonic()
            hit = self.cache.get(spec)
            if hit is not None:
                job = CompileJob(spec, now)
                job.future.set_result(hit)
                return job
            job = self._compiling.get(spec)
            if job is not None:
                job.waiters += 1
                return job
            job = self._compiling[spec] = CompileJob(spec, now)
            self._queue.append(job)
            self._tend()
            self._cond.notify_all()
            return job

    def release(self, job: CompileJob) -> None:
        """A request no longer waits for job (aborted, or refused past its deadline);
        with nobody left waiting, the job is given up (dequeued, or its compile
        abandoned)."""
        with self._cond:
            if job.done():
                return
            job.waiters -= 1
            if job.waiters <= 0:
                self._abandon(job)

    def refusal(self, job: CompileJob, now: float) -> Refusal | None:
        """Why a job not yet done is refused now, or None while it has time: it has
        compiled for longer than the deadline (400: the spec's cost), or the compiler
        has been stalled that long (no lane: MAX_ABANDONED compiles given up on still
        run) with the job still queued (503: busy). A job queued behind a running lane
        waits: each job ahead of it takes at most the deadline."""
        if not self.timeout:
            return None
        started = job.started
        if started is not None and now - started > self.timeout:
            return Refusal(f"the grammar did not compile within {self.timeout:g} s "
                           "(--grammar-compile-timeout)", 400)
        stalled = self._stalled_since
        if started is None and stalled is not None \
                and now - max(job.submitted, stalled) > self.timeout:
            return Refusal("the grammar compiler is busy (too many compiles given up on "
                           f"are still running): this grammar did not start compiling "
                           f"within {self.timeout:g} s", 503)
        return None

    def tend(self) -> None:
        """Starts a lane if jobs wait and none runs (one that was abandoned with the
        limit of abandoned threads reached gets its successor here, once one ends).
        Called from the engine's thread: a thread inherits its creator's priority,
        and an abandoned lane runs at the lowest."""
        with self._cond:
            self._tend()

    def take_compile_seconds(self) -> list[float]:
        """How long each compile finished since the last call took (for metrics)."""
        with self._cond:
            taken, self._compile_seconds = self._compile_seconds, []
        return taken

    def build(self, spec: StructuredOutput) -> Grammar:
        """The grammar for spec over the vocabulary: the costly call, on a lane."""
        if uses_guidance(spec, self._backend):
            from kvserve.engine.structured.guidance import GuidanceGrammar, guidance_grammar
            return GuidanceGrammar(self._guidance_tokenizer, guidance_grammar(spec),
                                   self._stops)
        return XgrammarGrammar(self._xgrammar.compile_grammar(parse(spec)))

    # -- under self._cond --------------------------------------------------------
    def _tend(self) -> None:
        if self._lane is not None or not self._queue:
            self._stalled_since = None
        elif self._abandoned < MAX_ABANDONED:
            self._stalled_since = None
            self._lane = threading.Thread(target=self._run_lane, name="kvserve-grammar",
                                          daemon=True)
            self._lane.start()
        elif self._stalled_since is None:
            self._stalled_since = time.monotonic()

    def _abandon(self, job: CompileJob) -> None:
        job.future.cancel()  # never set running: anyone still waiting hears it
        if self._compiling.get(job.spec) is job:
            del self._compiling[job.spec]  # the same spec again starts afresh
        if job.started is None:
            self._queue.remove(job)
            return
        if job is self._running:  # its thread cannot be stopped: left to finish
            thread, self._lane, self._running = self._lane, None, None
            self._abandoned += 1
            _lower_priority(thread)
            log.warning("gave up on a grammar compile after %.1f s (its requests are "
                        "gone or past --grammar-compile-timeout); it finishes at the "
                        "lowest priority (%d such now)", time.monotonic() - job.started,
                        self._abandoned)
            self._tend()

    # -- the lane -------------------------------------------------------------------
    def _run_lane(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                job = self._queue.popleft()
                job.started, self._running = time.monotonic(), job
            t0 = time.perf_counter()
            try:
                grammar, error = self.build(job.spec), None
            except Exception as exc:  # noqa: BLE001 - the job's, told to its requests
                grammar, error = None, exc
            with self._cond:
                self._finish(job, grammar, error, time.perf_counter() - t0)
                if self._lane is not me:  # abandoned while it compiled: it ends here
                    self._abandoned -= 1
                    return
                self._running = None

    def _finish(self, job: CompileJob, grammar: Grammar | None, error: Exception | None,
                seconds: float) -> None:
        """Cached in the same breath as it stops being compiled."""
        self._compile_seconds.append(seconds)
        if grammar is not None:
            self.cache.put(job.spec, grammar, grammar.nbytes)
        if job.future.cancelled():
            return
        del self._compiling[job.spec]
        if error is None:
            job.future.set_result(grammar)
        else:
            job.future.set_exception(error)


def _lower_priority(thread: threading.Thread | None) -> None:
    """The lowest CPU priority for one thread (Linux: a thread is a task with its own
    nice value; lowering it needs no privilege). Elsewhere it keeps its priority."""
    if thread is None or thread.native_id is None or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, thread.native_id, LOWEST_PRIORITY)
    except OSError:  # it has just ended
        pass
