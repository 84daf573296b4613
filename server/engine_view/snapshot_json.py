"""An EngineSnapshot as the page reads it (JSON), built once per snapshot for each
kind of watcher. The block map travels as a string of state digits; a cache with
more blocks than MAX_CELLS is drawn coarser, each cell the most telling state of the
blocks it covers (the digits are ordered so: free < cached < used < shared <
copy-on-write). Block tables travel as runs, [first, count], which are few: blocks
are handed out in order from the free queue.

A request's engine id is shown only where `shows(id)` (an admin key's watchers, or
the request's own key's: server/engine_view/hub.py); every request also has a `ref`,
a keyed hash of its id that tells rows apart across snapshots and nothing else.

A decoding request's progress is its output tokens against the most it may have
(`max_tokens`); a sequence that ended tells the output tokens its client got, or,
an embedding's, that it was one and its prompt's length (server/engine_view/endings.py)."""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Iterable

from kvserve.engine.client.engine_client import FinishedSequence
from kvserve.engine.core.reports import EngineSnapshot
from kvserve.scheduler.snapshot import STATE_NAMES, RequestView
from kvserve.server.engine_view.endings import Endings

MAX_CELLS = 32768


def coarsen(states: bytes, max_cells: int = MAX_CELLS) -> tuple[str, int]:
    """(cells, blocks per cell): the map itself when it fits, else groups of blocks."""
    per_cell = max(1, -(-len(states) // max_cells))
    if per_cell == 1:
        return states.decode("ascii"), 1
    return bytes(max(states[i:i + per_cell]) for i in range(0, len(states), per_cell)
                 ).decode("ascii"), per_cell


def runs(block_ids: Iterable[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for block_id in block_ids:
        if out and out[-1][0] + out[-1][1] == block_id:
            out[-1][1] += 1
        else:
            out.append([block_id, 1])
    return out


_REF_KEY = secrets.token_bytes(16)  # this process's: refs mean nothing elsewhere


def ref(request_id: str) -> str:
    """A stable stand-in for an engine id that reveals nothing of it."""
    return hmac.new(_REF_KEY, request_id.encode(), hashlib.sha256).hexdigest()[:12]


def _shown(request_id: str, shows: Callable[[str], bool]) -> dict:
    return {"id": request_id if shows(request_id) else None, "ref": ref(request_id)}


def max_output_tokens(view: RequestView, max_model_len: int) -> int:
    """The most output tokens the request may end with: its max_tokens, within the
    room its prompt leaves in the context (a request sent without max_tokens is given
    all of that room: server/validation.py)."""
    room = max_model_len - view.num_prompt_tokens
    return min(view.max_tokens, room) if view.max_tokens else room


def _request(view: RequestView, shows: Callable[[str], bool], max_model_len: int) -> dict:
    return {**_shown(view.request_id, shows), "index": view.index, "phase": view.phase,
            "prompt_tokens": view.num_prompt_tokens, "tokens": view.num_tokens,
            "computed_tokens": view.num_computed_tokens,
            "output_tokens": view.num_tokens - view.num_prompt_tokens,
            "max_tokens": max_output_tokens(view, max_model_len),
            "cached_tokens": view.num_cached_tokens, "preemptions": view.num_preemptions,
            "blocks": runs(view.block_ids), "lora": view.lora}


def _finished(f: FinishedSequence, endings: Endings | None) -> dict:
    """reason: the engine's finish reason; output_tokens: what its client got (none,
    for an embedding: embedding is true and prompt_tokens its prompt's length)."""
    ending = endings.get(f.request_id, f.index) if endings is not None else None
    embedding = ending is not None and ending.embedding
    unsent = ending.unsent_tokens if ending is not None else 0
    return {"index": f.index, "reason": f.reason, "embedding": embedding,
            "prompt_tokens": ending.prompt_tokens if ending is not None else None,
            "output_tokens": 0 if embedding else max(0, f.num_generated - unsent)}


def snapshot_json(snapshot: EngineSnapshot, finished: Iterable[FinishedSequence],
                  max_model_len: int,
                  shows: Callable[[str], bool] = lambda request_id: True,
                  endings: Endings | None = None) -> dict:
    sched, now, wall = snapshot.scheduler, time.monotonic(), time.time()
    states = sched.block_states
    cells, per_cell = coarsen(states)
    return {
        "t": (wall - (now - snapshot.taken_at)) * 1000,  # when it was taken (ms)
        "speculative": snapshot.speculative,
        "block_size": sched.block_size,
        "num_blocks": len(states),
        "blocks_per_cell": per_cell,
        "cells": cells,
        "block_counts": {name: states.count(ord("0") + i)
                         for i, name in enumerate(STATE_NAMES)},
        "num_running": sum(r.phase in ("prefill", "decode") for r in sched.requests),
        "num_waiting": sched.num_waiting,
        "requests": [_request(r, shows, max_model_len) for r in sched.requests],
        "finished": [{**_shown(f.request_id, shows), **_finished(f, endings),
                      "t": (wall - (now - f.at)) * 1000} for f in finished],
    }
