"""A step the device side failed for some of its requests: what the scheduler must
undo in its KV cache so that nobody reads KV that was never written."""
from __future__ import annotations

from kvserve.kvcache import KVCacheManager
from kvserve.scheduler.output import SchedulerOutput


def withdraw_unwritten(kv: KVCacheManager, out: SchedulerOutput,
                       failed: dict[str, str]) -> None:
    """Requests of `out` left out at preparation (`failed`: request id -> why)
    wrote no KV, yet their blocks were offered for sharing when `out` was
    scheduled: they leave the prefix cache now, before the next schedule could hit
    them. A request of the step that already hit one (a prefix shared within the
    step) read KV nobody wrote: it is added to `failed`, and so, in turn, is
    anyone sharing its blocks."""
    bs = kv.block_size
    unwritten: set[int] = set()
    changed = True
    while changed:  # until no one new reads what a failed request was to write
        changed = False
        for s in out.scheduled:
            rid, first = s.request.request_id, s.start // bs
            if rid not in failed and unwritten.isdisjoint(s.block_table[:first]):
                continue
            failed.setdefault(rid, "its cached prompt prefix came from a request "
                                   "whose step failed")
            own = s.block_table[first:]  # the blocks this step was to write
            if not unwritten.issuperset(own):
                unwritten.update(own)
                kv.uncache(rid, s.start)
                changed = True
