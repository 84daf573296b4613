"""Between steps: which running requests verify drafts in the next step, and (for
the n-gram method) what the drafts are. Model-based drafts (early exit) are only
counted here, as placeholders the runner fills once the step's slots exist.

Also keeps the acceptance counts the metrics export (kvserve:spec_decode_*)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.engine.config.engine_config import SpeculativeConfig
from kvserve.engine.spec_decode.ngram import NgramProposer
from kvserve.scheduler.request import Request, RequestStatus

PLACEHOLDER = -1  # a draft the runner's drafter has yet to choose


@dataclass
class SpecDecodeStats:
    """Cumulative counts; the engine loop reports their growth each step."""
    num_drafts: int = 0  # verifications: requests that carried drafts into a step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]

    def record(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        """proposed[i], accepted[i]: drafts request i carried and had accepted."""
        width = max(proposed, default=0)
        if len(self.accepted_per_position) < width:
            self.accepted_per_position += [0] * (width - len(self.accepted_per_position))
        for n, a in zip(proposed, accepted):
            self.num_drafts += 1
            self.num_draft_tokens += n
            self.num_accepted_tokens += a
            for pos in range(a):
                self.accepted_per_position[pos] += 1

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.accepted_per_position))

    def since(self, earlier: SpecDecodeStats) -> SpecDecodeStats:
        """The counts added after `earlier` (a copy of these, taken before)."""
        old = earlier.accepted_per_position
        old = old + [0] * (len(self.accepted_per_position) - len(old))
        return SpecDecodeStats(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.accepted_per_position, old)])

    def add(self, delta: SpecDecodeStats) -> None:
        self.num_drafts += delta.num_drafts
        self.num_draft_tokens += delta.num_draft_tokens
        self.num_accepted_tokens += delta.num_accepted_tokens
        grow = len(delta.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(0, grow)
        for pos, n in enumerate(delta.accepted_per_position):
            self.accepted_per_position[pos] += n


class Speculator:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpecDecodeStats()
        self._ngram = NgramProposer(config.num_tokens, config.ngram_max, config.ngram_min) \
            if config.method == "ngram" else None

    def propose(self, running: Sequence[Request]) -> None:
        """Sets spec_token_ids on the running requests that will decode next step."""
        limit = self.config.disable_batch_size
        if not running or (limit and len(running) > limit):
            return
        for req in running:
            k = self._room(req)
            if k <= 0:
                continue
            if self._ngram is None:
                req.spec_token_ids = [PLACEHOLDER] * k
            else:
                req.spec_token_ids = self._ngram.propose(req.request_id, req.token_ids, k)

    def _room(self, req: Request) -> int:
        """Drafts worth verifying for req: none unless its next step is a decode it
        allows speculation for; never more than its remaining tokens need."""
        p = req.params
        if (not p.speculative or p.logprobs is not None or req.pending_forks
                or req.status is not RequestStatus.RUNNING
                or len(req.token_ids) - req.num_computed_tokens != 1):
            return 0
        return min(self.config.num_tokens, p.max_tokens - req.num_output_tokens - 1)

    def release(self, request_id: str) -> None:
        if self._ngram is not None:
            self._ngram.release(request_id)
