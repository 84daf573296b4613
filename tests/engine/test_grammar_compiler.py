"""The grammar compiler's deadline, its giving up on compiles nobody waits for, and
its cache bounded in bytes, on a tiny model (its tokenizer is all a grammar needs).
A compile is made slow on purpose by holding its build (tests/support/held_compile.py)."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from kvserve.engine.structured import compiler as compiler_module
from kvserve.engine.structured.compiler import GrammarCompiler
from kvserve.engine.structured.grammar_cache import GrammarCache
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.structured_output import StructuredOutput
from tests.support.held_compile import held_compile  # noqa: F401 - a fixture

FAST = StructuredOutput("choice", '["yes", "no"]')


def params(spec: StructuredOutput, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, structured=spec, **kw)


def run_until_idle(engine, timeout: float = 30.0) -> dict[str, object]:
    """Steps the engine until nothing is left; each request's last output."""
    last, deadline = {}, time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in engine.step():
            last[out.request_id] = out
    return last


def assert_idle(engine) -> None:
    kv = engine.scheduler.kv
    assert not engine.has_unfinished_requests() and len(engine.grammars) == 0
    assert kv.num_free_blocks == kv.num_blocks


def nice_of(thread: threading.Thread) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


def test_a_compile_past_the_deadline_is_a_400_while_the_next_grammar_is_served(
        tiny_engine_factory, held_compile):
    engine = tiny_engine_factory(grammar_compile_timeout=0.5)
    ids = engine.tokenizer.encode("hi")
    t0 = time.monotonic()
    engine.add_request("slow", ids, params(held_compile.spec))
    engine.add_request("fast", ids, params(FAST))
    engine.add_request("free", ids, SamplingParams(max_tokens=3, temperature=0.0))
    last = run_until_idle(engine)
    took = time.monotonic() - t0
    slow = last["slow"]
    assert slow.finish_reason == "error" and slow.error_status == 400
    assert "--grammar-compile-timeout" in slow.error and not slow.new_token_ids
    assert last["fast"].finish_reason == "stop" and last["free"].finish_reason == "length"
    assert not held_compile.is_set() and took < 5  # nobody waited for its compile
    assert_idle(engine)
    if sys.platform.startswith("linux"):  # the given-up compile runs on, out of the way
        assert nice_of(held_compile.threads[0]) == compiler_module.LOWEST_PRIORITY


def test_an_abort_during_compile_frees_the_engine_and_gives_the_compile_up(
        tiny_engine_factory, held_compile):
    engine = tiny_engine_factory(grammar_compile_timeout=0)  # no deadline at all
    compiler = engine.grammars.compiler
    ids = engine.tokenizer.encode("hi")
    engine.add_request("slow", ids, params(held_compile.spec, n=2))
    engine.step()
    while not held_compile.threads:  # its compile has begun
        time.sleep(0.01)
    aborted = engine.abort_request("slow")
    assert [(o.index, o.finish_reason) for o in aborted] == [(0, "abort"), (1, "abort")]
    assert_idle(engine)
    t0 = time.monotonic()
    engine.add_request("next", ids, params(FAST))
    assert run_until_idle(engine)["next"].finish_reason == "stop"
    assert time.monotonic() - t0 < 5 and not held_compile.is_set()
    assert compiler._abandoned == 1
    held_compile.set()  # the given-up compile ends; what it made is kept
    held_compile.threads[0].join(10)
    assert compiler._abandoned == 0 and held_compile.spec in compiler.cache
    assert_idle(engine)


def test_a_compile_shared_by_two_requests_goes_on_when_one_is_aborted(
        tiny_engine_factory, held_compile):
    engine = tiny_engine_factory(grammar_compile_timeout=0)
    ids = engine.tokenizer.encode("hi")
    engine.add_request("a", ids, params(held_compile.spec))
    engine.add_request("b", ids, params(held_compile.spec))
    engine.step()
    engine.abort_request("a")
    held_compile.set()
    last = run_until_idle(engine)
    assert last["b"].finish_reason in ("stop", "length") and last["b"].error is None
    assert engine.grammars.compiler._abandoned == 0
    assert_idle(engine)


def test_with_too_many_compiles_given_up_a_waiting_grammar_is_a_503(
        tiny_engine_factory, held_compile, monkeypatch):
    monkeypatch.setattr(compiler_module, "MAX_ABANDONED", 1)
    engine = tiny_engine_factory(grammar_compile_timeout=0.3)
    ids = engine.tokenizer.encode("hi")
    engine.add_request("slow", ids, params(held_compile.spec))
    engine.add_request("queued", ids, params(FAST))
    last = run_until_idle(engine)
    assert (last["slow"].error_status, last["queued"].error_status) == (400, 503)
    assert "busy" in last["queued"].error
    held_compile.set()
    held_compile.threads[0].join(10)
    engine.add_request("later", ids, params(FAST))  # a lane again, once it ended
    assert run_until_idle(engine)["later"].finish_reason == "stop"
    assert_idle(engine)


def test_an_invalid_grammar_found_by_the_compiler_is_a_400(tiny_engine_factory):
    engine = tiny_engine_factory()
    engine.add_request("bad", engine.tokenizer.encode("hi"),
                       params(StructuredOutput("grammar", "root ::= ")))
    bad = run_until_idle(engine)["bad"]
    assert bad.error_status == 400 and "invalid grammar" in bad.error


def test_the_cache_drops_the_least_recently_used_to_stay_within_its_bytes():
    cache = GrammarCache(max_bytes=1000)
    a, b, c = (StructuredOutput("regex", x) for x in ("a", "b", "c"))
    assert cache.put(a, "A", 400) and cache.put(b, "B", 400)
    assert cache.get(a) == "A"  # now b is the least recently used
    assert cache.put(c, "C", 400)
    assert a in cache and c in cache and b not in cache
    assert cache.nbytes == 802 <= cache.max_bytes  # each key's text is charged too
    assert not cache.put(StructuredOutput("regex", "d"), "D", 1000)  # alone over
    assert len(cache) == 2 and cache.nbytes == 802
    assert GrammarCache(0).put(a, "A", 0) is False  # 0: keep none


def test_the_compilers_cache_is_bounded_by_its_grammars_own_sizes(tiny_engine_factory):
    engine = tiny_engine_factory()
    tokenizer = engine.tokenizer
    specs = [StructuredOutput("regex", f"[a-z]{{{n}}}") for n in (3, 4, 5)]
    sizes = [GrammarCompiler(tokenizer, engine.model_config.vocab_size,
                             list(engine.eos_token_ids)).build(s).nbytes for s in specs]
    budget = sizes[1] + sizes[2] + sum(len(s.spec) for s in specs[1:])
    compiler = GrammarCompiler(tokenizer, engine.model_config.vocab_size,
                               list(engine.eos_token_ids), cache_bytes=budget)
    for spec in specs:
        compiler.submit(spec).result(10)
    assert specs[0] not in compiler.cache and specs[1] in compiler.cache \
        and specs[2] in compiler.cache
    assert compiler.cache.nbytes <= budget
    assert compiler.submit(specs[2]).done()  # a hit: no compile
