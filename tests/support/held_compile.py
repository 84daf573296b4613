"""A grammar compile made slow on purpose: the build of the fixture's spec (a new one
for each test: what a given-up compile made is kept in the cache, and a later test
would find it there) waits until the test lets it go. Deterministic, where a pathological grammar's cost depends on the
machine (ten strings of maxLength 3000 take ~28 s on one, a few on another)."""
from __future__ import annotations

import itertools
import threading

import pytest

from kvserve.engine.structured.compiler import GrammarCompiler
from kvserve.scheduler.structured_output import StructuredOutput

_lengths = itertools.count(4)


@pytest.fixture
def held_compile(monkeypatch):
    """`.spec`'s build blocks until .set() (done at the test's end at the latest);
    `.threads`: the threads it blocked."""
    gate = threading.Event()
    gate.spec = StructuredOutput("regex", f"[ab]{{{next(_lengths)}}}")
    gate.threads = []
    build = GrammarCompiler.build

    def slow_build(self, spec):
        if spec == gate.spec:
            gate.threads.append(threading.current_thread())
            gate.wait(60)
        return build(self, spec)

    monkeypatch.setattr(GrammarCompiler, "build", slow_build)
    yield gate
    gate.set()
