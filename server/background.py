"""Whether the request being served is a batch job's line (server/batch/), run
through the app in this process: its engine requests are background ones, scheduled
after every interactive request (scheduler/waiting_queue.py), and admission's
limits, which keep interactive clients' queue short, do not turn it away (the batch
runner bounds how many of its lines are in flight). A context variable: only code
in this process sets it, never a client."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_BACKGROUND: ContextVar[bool] = ContextVar("kvserve_background", default=False)


def in_background() -> bool:
    return _BACKGROUND.get()


@contextlib.contextmanager
def background() -> Iterator[None]:
    token = _BACKGROUND.set(True)
    try:
        yield
    finally:
        _BACKGROUND.reset(token)
