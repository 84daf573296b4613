"""What completions and chat responses share: the envelope (id, object, created,
model), the SSE loop (chunks, a mid-stream error, the usage chunk, [DONE]) and the
whole-body assembly. Subclasses say how one choice looks."""
from __future__ import annotations

import contextlib
import time

from kvserve.server import generation
from kvserve.server.errors import APIError, sse_data, sse_error
from kvserve.server.generation import ChoiceDelta, PromptGroup
from kvserve.server.logprobs import TokenText
from kvserve.server.metrics.frontend import current_clock


class ResponseView:
    body_object = ""  # e.g. "text_completion"
    chunk_object = ""

    def __init__(self, rid: str, model: str, req, groups: list[PromptGroup], tokenizer):
        self.rid, self.model, self.req, self.groups = rid, model, req, groups
        self.tokenizer = tokenizer
        self.token_text = TokenText(tokenizer)
        self.created = int(time.time())
        self.clock = current_clock()  # TTFT / ITL / e2e of what sse() sends

    # -- what a subclass defines ---------------------------------------------
    def choice(self, index: int, deltas: list[ChoiceDelta]) -> dict:
        """A whole choice of a non-streaming body."""
        raise NotImplementedError

    def chunk_choices(self, d: ChoiceDelta) -> list[dict]:
        """The streamed choices (one per chunk) that carry this delta."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------
    def envelope(self, obj: str, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.rid, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def body(self, results: dict[int, list[ChoiceDelta]]) -> dict:
        choices = [self.choice(i, results[i]) for i in sorted(results)]
        last = {i: ds[-1] for i, ds in results.items()}
        body = self.envelope(self.body_object, choices, generation.usage(self.groups, last))
        # vLLM's top-level field, which a P/D router hands to the decode instance.
        handoff = next((d.kv_transfer_params for ds in results.values() for d in ds
                        if d.kv_transfer_params is not None), None)
        if handoff is not None:
            body["kv_transfer_params"] = handoff
        return body

    async def sse(self, events):
        """events: batches of deltas; each batch goes out as one write."""
        last: dict[int, ChoiceDelta] = {}
        async with contextlib.aclosing(events):  # closing it aborts what still runs
            async for batch in events:
                error = batch.pop() if isinstance(batch[-1], APIError) else None
                parts = []
                for item in batch:
                    last[item.index] = item
                    usage = (generation.usage(self.groups, last)
                             if self.req.continuous_usage else None)
                    parts.extend(sse_data(self.envelope(self.chunk_object, [choice], usage))
                                 for choice in self.chunk_choices(item))
                if error is not None:  # only ever the last item: the stream ends here
                    parts.append(sse_error(error.status, error.message))
                yield "".join(parts)
                self.clock.sent(batch)  # resumed only once the server has sent it
                if error is not None:
                    break
            else:
                if self.req.include_usage:
                    usage = generation.usage(self.groups, last)
                    yield sse_data(self.envelope(self.chunk_object, [], usage))
        yield "data: [DONE]\n\n"
