"""The engine in a process of its own (vLLM v1 splits its EngineCore off the same
way). The server's event loop then never competes with the engine for the GIL: at
hundreds of streams the front end's per-token work (SSE, JSON, detokenizing) takes
as long as a GPU decode step, and in one process it would stretch every step.

Parent and child share one duplex pipe: commands go down; EngineReady (or EngineDied)
comes up once, then one StepReport per loop iteration, read by a thread in the parent
that hands outputs to the event loops, and EngineDied if the engine stops. The child is spawned (not forked: torch and CUDA do not survive a fork)."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from kvserve.engine.client.engine_client import EngineClient, EngineDeadError
from kvserve.engine.client.messages import (EngineCommand, EngineDied, EngineReady, Shutdown,
                                            StepReport)
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.reports import EngineInfo

log = logging.getLogger("kvserve.process_engine")

STARTUP_TIMEOUT_S = 600.0  # loading an 8B checkpoint can take minutes


class EngineStartError(RuntimeError):
    pass


class _PipeSource:
    def __init__(self, conn: Connection):
        self.conn = conn

    def take(self, wait: float | None) -> list[EngineCommand]:
        commands = []
        if self.conn.poll(wait):
            commands.append(self.conn.recv())
        while self.conn.poll():
            commands.append(self.conn.recv())
        return commands


def _child_main(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The engine process: load, say ready, loop until told to stop."""
    # Ctrl-C reaches the whole process group, docker stop only the parent: either
    # way the parent drains and then stops us, so the signals are its business.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    from kvserve.engine.core.engine import Engine
    from kvserve.engine.client.engine_loop import EngineLoop
    from kvserve.engine.platform.heap import freeze_startup_heap

    try:
        engine = Engine(config)
    except BaseException as exc:
        conn.send(EngineDied(f"{type(exc).__name__}: {exc}"))
        return
    send_lock = threading.Lock()  # the loop reports; a rank's watcher may say it died

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    def rank_died(why: str) -> None:
        logging.getLogger("kvserve.engine").critical("%s", why)
        send(EngineDied(why))
        os._exit(1)  # the loop may be blocked in a collective that never completes

    engine.on_rank_death(rank_died)
    freeze_startup_heap()
    send(EngineReady(engine.info()))
    try:
        EngineLoop(engine, _PipeSource(conn), send).run()
    except BaseException as exc:
        logging.getLogger("kvserve.engine").exception("engine loop died")
        send(EngineDied(f"{type(exc).__name__}: {exc}"))
    engine.close()
    from kvserve.engine.runner.compile_process import exit_if_compiling

    exit_if_compiling(0)


class ProcessEngine(EngineClient):
    """Blocks in the constructor until the child has loaded the model, as building
    an Engine in-process would."""

    def __init__(self, config: EngineConfig, tokenizer=None,
                 load_tokenizer: Callable[[], object] | None = None):
        """load_tokenizer: called (for the tokenizer) once the child is on its way, so
        transformers' import and the tokenizer's parse (~3 s on a 2-core AVX2 EPYC)
        overlap the child's own imports and load instead of delaying them."""
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_child_main, name="kvserve-engine-core",
                                    args=(config, child_conn, logging.getLogger().level),
                                    daemon=True)
        self._process.start()
        child_conn.close()
        if load_tokenizer is not None:
            try:
                tokenizer = load_tokenizer()
            except BaseException:
                self._process.kill()
                self._process.join(5)
                raise
        super().__init__(tokenizer, self._await_ready())
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="kvserve-engine-reader",
                                        daemon=True)

    def _await_ready(self) -> EngineInfo:
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self._process.kill()
            raise EngineStartError("the engine process did not start in time")
        try:
            message = self._conn.recv()
        except EOFError:  # it died without a word (killed, or a crash in C)
            self._process.join(5)
            message = EngineDied(f"exit code {self._process.exitcode}")
        if not isinstance(message, EngineReady):
            raise EngineStartError(f"the engine process failed to start: {message.reason}")
        return message.info

    def start(self) -> None:
        self._reader.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._process.is_alive():
            try:
                self._submit(Shutdown())
            except EngineDeadError:  # it died meanwhile
                pass
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
        if self._reader.ident is not None:  # an engine never started has no reader
            self._reader.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._process.is_alive() and self.error is None

    def _submit(self, command: EngineCommand) -> None:
        with self._send_lock:  # the event loop and shutdown may both send
            try:
                self._conn.send(command)
            except OSError as exc:  # the process is gone: the pipe is broken
                raise EngineDeadError(f"the engine process is gone ({exc!r})") from exc

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the process is gone, stopped or killed
                self._process.join(1)
                if self.error is None:
                    self._on_dead(RuntimeError(
                        f"engine process exited (code {self._process.exitcode})"))
                return
            if isinstance(message, StepReport):
                self._on_report(message)
            elif isinstance(message, EngineDied):
                self._on_dead(RuntimeError(message.reason))
                return
