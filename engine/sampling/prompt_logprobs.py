"""Prompt logprobs across chunked prefill: the logits at position i give the logprob
of prompt token i + 1, so a request's chunks each contribute the positions they
compute (the last prompt position samples instead). The runner keeps what each
request has so far and hands the list over in the step that samples its first token.
A request recomputed after preemption skips the positions it already has."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.platform.outputs import TokenLogprob
from kvserve.scheduler.output import ScheduledRequest
from kvserve.scheduler.request import Request


@dataclass
class PromptSpan:
    request: Request
    row: int  # its first row in the flat batch
    first: int  # its first position: gives the logprob of prompt token first + 1
    count: int

    @property
    def targets(self) -> list[int]:
        return self.request.token_ids[self.first + 1:self.first + 1 + self.count]


class PromptLogprobs:
    def __init__(self) -> None:
        self._done: dict[str, list[TokenLogprob]] = {}

    def plan(self, scheduled: list[ScheduledRequest],
             query_starts: list[int]) -> list[PromptSpan]:
        """The positions of this step whose logits prompt logprobs still need."""
        spans = []
        for i, s in enumerate(scheduled):
            req = s.request
            if not req.needs_prompt_logits:
                continue
            have = len(self._done.setdefault(req.request_id, []))
            if have < s.start:  # the scheduler skips prefix hits for these requests
                raise RuntimeError(f"{req.request_id}: prompt logprobs of positions "
                                   f"{have}..{s.start - 1} were never computed")
            first = max(s.start, have)
            end = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1)
            if end > first:
                spans.append(PromptSpan(req, query_starts[i] + first - s.start,
                                        first, end - first))
        return spans

    def add(self, span: PromptSpan, items: list[TokenLogprob]) -> None:
        done = self._done.get(span.request.request_id)
        if done is not None:  # None: the request ended (aborted) while its step ran
            done.extend(items)

    def take(self, request_id: str) -> list[TokenLogprob | None]:
        """The whole prompt's list (the first token has none); forgets it."""
        return [None, *self._done.pop(request_id, [])]

    def release(self, request_id: str) -> None:
        self._done.pop(request_id, None)

    def copy(self) -> PromptLogprobs:
        """An independent copy (the sampler's probe runs work on one)."""
        other = PromptLogprobs()
        other._done = {rid: list(items) for rid, items in self._done.items()}
        return other

    def __len__(self) -> int:
        """Requests with prompt logprobs in progress."""
        return len(self._done)
