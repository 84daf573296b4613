"""Logits adjustments for verification rows. Row j (0..k) of a request with drafts
x_1..x_k predicts the token after x_1..x_j, so its min-tokens mask, bad words and
penalties must see those j draft tokens as already generated; logit_bias and the
allowed_token_ids mask are the same on every row.
`DraftPosition` shows a request as it would be at row j, with the attributes that
`engine.sampling.adjustments.build_adjustments` reads, so the engine's own builder
makes the adjustments of all k + 1 rows."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.sampling.adjustments import LogitAdjustments, build_adjustments
from kvserve.scheduler.request import Request


class DraftPosition:
    """A read-only view of `request` with `drafts` appended to its output."""

    __slots__ = ("request", "drafts")

    def __init__(self, request: Request, drafts: Sequence[int]):
        self.request = request
        self.drafts = list(drafts)

    @property
    def params(self):
        return self.request.params

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def banned_stop_ids(self) -> tuple[int, ...]:
        # Banned at this row iff fewer than min_tokens tokens precede it; the set
        # banned is the request's own (non-empty while it has fewer itself).
        if self.num_output_tokens >= self.request.params.min_tokens:
            return ()
        return self.request.banned_stop_ids


def draft_positions(requests: Sequence[Request],
                    drafts: Sequence[Sequence[int]]) -> list[DraftPosition]:
    """Each request's k + 1 verification rows in order, flattened."""
    return [DraftPosition(req, d[:j]) for req, d in zip(requests, drafts)
            for j in range(len(d) + 1)]


def verification_adjustments(requests: Sequence[Request], drafts: Sequence[Sequence[int]],
                             vocab: int, device: torch.device) -> LogitAdjustments | None:
    """The adjustments of the flattened verification rows (None: none needed)."""
    return build_adjustments(draft_positions(requests, drafts), vocab, device)
