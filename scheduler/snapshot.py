"""A picture of the scheduler for the live engine view (GET /v1/engine/stream): each
request's place and progress, and the KV cache's block map. Built only when the
engine is asked for one, a few times a second while someone watches; plain data, so
it crosses the engine process's pipe like a StepReport."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.kvcache.block_map import STATE_NAMES
from kvserve.scheduler.request import Request, RequestStatus

__all__ = ["STATE_NAMES", "RequestView", "SchedulerSnapshot"]

# Waiting requests listed by name; past this only their count is told (stats()), so
# a long queue never makes a snapshot large.
MAX_WAITING_LISTED = 64


@dataclass(frozen=True, slots=True)
class RequestView:
    request_id: str  # the client's request, as the engine was given it
    index: int  # which of its n sequences
    # "prefill": computing known tokens (its prompt, in chunks, or all of it again
    # after a preemption); "decode": one new token a step; "waiting": not admitted
    # yet; "preempted": back in the queue, its blocks freed, to be recomputed.
    phase: str
    num_prompt_tokens: int
    num_tokens: int  # known tokens: the prompt and what was generated
    num_computed_tokens: int  # of those, with their KV computed (or being computed)
    num_cached_tokens: int  # prompt tokens that came from the prefix cache
    num_preemptions: int
    block_ids: tuple[int, ...]  # its block table (running requests only)
    lora: str | None = None
    max_tokens: int = 0  # the most it may generate (its request's max_tokens)


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    requests: tuple[RequestView, ...]  # running first, then waiting in queue order
    num_waiting: int  # all of them, listed or not
    block_size: int
    # One ASCII digit per block: "0" + i is STATE_NAMES[i] (kvcache/block_map.py).
    block_states: bytes

    @staticmethod
    def of(scheduler) -> "SchedulerSnapshot":
        kv = scheduler.kv
        views = [_view(r, tuple(kv.live_block_table(r.request_id))) for r in scheduler.running]
        for i, req in enumerate(scheduler.waiting):
            if i == MAX_WAITING_LISTED:
                break
            views.append(_view(req, ()))
        return SchedulerSnapshot(tuple(views), len(scheduler.waiting), kv.block_size,
                                 kv.block_states())


def _view(req: Request, block_ids: tuple[int, ...]) -> RequestView:
    if req.status is RequestStatus.RUNNING:
        # The last known token is computed by the step that samples the next one.
        phase = "prefill" if req.num_computed_tokens < req.num_tokens - 1 else "decode"
    else:
        phase = "preempted" if req.num_preemptions else "waiting"
    return RequestView(req.group_id, req.index, phase, req.num_prompt_tokens,
                       req.num_tokens, req.num_computed_tokens, req.num_cached_tokens,
                       req.num_preemptions, block_ids, req.lora, req.params.max_tokens)
