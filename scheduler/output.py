"""What the scheduler hands the model runner for one step."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kvcache import BlockCopy
from kvserve.scheduler.request import Request


class ScheduledRequest:
    """One request's share of a step. Built for every running request every step,
    so it is a plain slotted class with its facts fixed at scheduling time."""

    __slots__ = ("request", "num_new_tokens", "block_table", "start", "samples",
                 "spec_token_ids", "num_pending", "group_tables")

    def __init__(self, request: Request, num_new_tokens: int, block_table: list[int],
                 spec_token_ids: list[int] | None = None,
                 group_tables: tuple[list[int], ...] = ()):
        self.request = request
        self.num_new_tokens = num_new_tokens  # tokens computed this step, from `start`
        # Drafts verified after the known tokens (query rows, not yet known tokens).
        self.spec_token_ids = spec_token_ids or []
        # The KV manager's live table (read-only, valid for this step): copying 256
        # tables a step was a tenth of the scheduler's time.
        self.block_table = block_table
        # A hybrid model's sliding-window layer groups' live tables (kvcache/hybrid.py;
        # () for every other model): block_table is the full-attention layers'.
        self.group_tables = group_tables
        self.start = start = request.num_computed_tokens
        # This step catches the request up with every token it knows, so the last
        # row's logits give its next token (a mid-prompt chunk samples nothing).
        # Under async scheduling the last of them may not be known yet: the runner
        # feeds those `num_pending` from the previous step's tokens on the device.
        known = len(request.token_ids)
        self.samples = start + num_new_tokens == known + request.num_pending_tokens
        self.num_pending = start + num_new_tokens - known if self.samples else 0

    def __repr__(self) -> str:
        return (f"ScheduledRequest({self.request.request_id!r}, start={self.start}, "
                f"new={self.num_new_tokens})")


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + len(s.spec_token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
