"""Watching the worker processes an engine started (tensor-parallel ranks, pipeline
stages): one that dies takes the engine down, as a dead engine loop does (health
503, the server exits non-zero); until someone watches, the process exits at once."""
from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvserve.ranks")


def _exit_now(why: str) -> None:
    log.critical("%s: the engine stops", why)
    os._exit(1)


class WorkerWatch:
    """procs[i] is rank first_rank + i, named `what` in the reason a death gives."""

    def __init__(self, procs: list[subprocess.Popen], what: str, first_rank: int = 1):
        self.procs, self.what, self.first_rank = procs, what, first_rank
        self.stopping = False
        self._on_death: Callable[[str], None] = _exit_now
        threading.Thread(target=self._watch, name="kvserve-rank-watch", daemon=True).start()

    def on_death(self, callback: Callable[[str], None]) -> None:
        """callback(why) runs on the watcher's thread when a worker dies."""
        self._on_death = callback

    def _watch(self) -> None:
        while not self.stopping:
            for rank, proc in enumerate(self.procs, start=self.first_rank):
                code = proc.poll()
                if code is not None and not self.stopping:
                    self._on_death(f"{self.what} {rank} died (exit code {code})")
                    return
            time.sleep(0.2)

    def stop(self, timeout: float = 10.0) -> None:
        """Waits for the workers to exit (killed if they do not within `timeout`)."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
