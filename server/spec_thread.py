"""Structured-output specs and tool definitions are read, held to their caps
(server/grammar_limits.py) and parsed by the grammar library on a thread of their
own, off the event loop.

Parsing is what the front end does with a spec before anything is scheduled (a bad
schema is a 400, not an error inside a 200 stream), and it is not free: within the
caps xgrammar takes up to ~0.1 s for one (90 ms for 128 levels of nesting, 20 ms for
5000 properties), far past them seconds to minutes. On the loop that stalled every
stream and /health; here the loop keeps running (xgrammar's parse releases the GIL:
the loop ran at its idle rate beside it). One thread, not the tokenizer's: a prompt
never waits behind someone's schema; and one for the whole process, since what each
parse costs is bounded by the caps. Requests asking for no grammar never come here."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# The process's, for its life; its thread starts at the first spec.
_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-spec")


async def run_off_loop(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the spec thread; what it raises is raised here."""
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_worker, call)
