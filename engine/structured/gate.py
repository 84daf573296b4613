"""Constrained requests wait here, out of the scheduler, while their grammar compiles
(on the compiler's thread): steps go on for everyone else meanwhile, and a request
enters the scheduler only with its grammar in hand. A request whose grammar fails,
or is not ready within --grammar-compile-timeout, leaves from here having held no
KV block; one aborted here (its client gone) lets go of its compile, which is given
up once nobody waits for it (compiler.py)."""
from __future__ import annotations

import concurrent.futures
import time

from kvserve.engine.structured.compiler import CompileJob, GrammarCompiler, Refusal
from kvserve.engine.structured.matchers import Matchers
from kvserve.scheduler.request import Request


class GrammarGate:
    def __init__(self, compiler: GrammarCompiler, matchers: Matchers):
        self.compiler, self.matchers = compiler, matchers
        self._held: dict[str, tuple[Request, CompileJob]] = {}

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
        if held is None:
            return None
        self.compiler.release(held[1])
        return held[0]

    def ready(self) -> tuple[list[Request], list[tuple[Request, Refusal]]]:
        """(requests whose grammar is in the matchers now, in arrival order; requests
        refused: their grammar failed to compile, or passed its deadline)."""
        admitted, failed = [], []
        now = time.monotonic()
        for rid, (req, job) in list(self._held.items()):
            if job.done():
                refusal = None
                try:
                    grammar = job.result()
                except (ValueError, RuntimeError) as exc:  # the spec's: the client's 400
                    refusal = Refusal(f"the structured output could not be compiled: {exc}",
                                      400)
                except Exception as exc:  # noqa: BLE001 - said in the request's output
                    refusal = Refusal(f"the structured output could not be compiled: "
                                      f"{type(exc).__name__}: {exc}", None)
            else:
                refusal = self.compiler.refusal(job, now)
                if refusal is None:
                    continue
                self.compiler.release(job)
            del self._held[rid]
            if refusal is None:
                self.matchers.start(rid, grammar)
                admitted.append(req)
            else:
                failed.append((req, refusal))
        self.compiler.tend()
        return admitted, failed

    def wait(self, timeout: float) -> None:
        """Until a grammar is ready (or timeout): an engine with nothing else to do
        sleeps instead of spinning, and deadlines are looked at every `timeout`."""
        concurrent.futures.wait([job.future for _, job in self._held.values()],
                                timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)
