"""Constrained requests wait here, out of the scheduler, while their grammar compiles
(on the compiler's thread): steps go on for everyone else meanwhile, and a request
enters the scheduler only with its grammar in hand."""
from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future

from engine.structured.grammars import GrammarCompiler
from engine.structured.matchers import Matchers
from scheduler.request import Request


class GrammarGate:
    def __init__(self, compiler: GrammarCompiler, matchers: Matchers):
        self.compiler, self.matchers = compiler, matchers
        self._held: dict[str, tuple[Request, Future]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, req: Request) -> None:
        self._held[req.request_id] = (req, self.compiler.submit(req.params.structured))

    def held(self) -> list[Request]:
        """The requests waiting for their grammar."""
        return [req for req, _ in self._held.values()]

    def drop(self, request_id: str) -> Request | None:
        """An aborted request that never reached the scheduler."""
        held = self._held.pop(request_id, None)
        return held[0] if held is not None else None

    def ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose grammar is in the matchers now, in arrival order; requests
        whose grammar failed to compile, with the reason)."""
        admitted, failed = [], []
        for rid, (req, future) in list(self._held.items()):
            if not future.done():
                continue
            del self._held[rid]
            try:
                self.matchers.start(rid, future.result())
                admitted.append(req)
            except Exception as exc:  # noqa: BLE001 - the request's, said in its output
                failed.append((req, f"the structured output could not be compiled: {exc}"))
        return admitted, failed

    def wait(self, timeout: float) -> None:
        """Until a grammar is ready (or timeout): an engine with nothing else to do
        sleeps instead of spinning."""
        concurrent.futures.wait([f for _, f in self._held.values()], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)
