"""What the engine page says of a sequence that ended, beyond what the engine client
keeps of it (FinishedSequence: its reason and the tokens the engine sampled):

- an embedding is told as one, with its prompt's length: it generates nothing, and
  the one token its step samples (max_tokens 1, finish reason "length") is never
  sent to anyone;
- the output tokens counted are those its client got: a token sampled after the
  client went away (a Stop just as the first token came) is the engine's, not the
  client's, and a Stop before any text is "aborted after 0 tokens".

A report listener, on the thread that receives the engine's reports: per step it
asks two things of each output (did it end a sequence, is its client still there)
and notes only what matters here, which is little: the last KEEP endings, and the
tokens sampled for clients already gone, until their sequences end."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.client.engine_client import RECENT_FINISHED, EngineClient
from kvserve.engine.client.messages import StepReport

# Endings noted: more than the engine client's list of those just finished, which
# the page shows (both see every ending, in the same order).
KEEP = 2 * RECENT_FINISHED


@dataclass(frozen=True, slots=True)
class Ending:
    embedding: bool  # a pooling request's: it generated nothing
    prompt_tokens: int
    unsent_tokens: int  # sampled after its client had gone


class Endings:
    def __init__(self, engine: EngineClient, keep: int = KEEP):
        self.engine, self.keep = engine, keep
        self._endings: dict[tuple[str, int], Ending] = {}  # oldest first
        self._unsent: dict[tuple[str, int], int] = {}  # sequences still running

    def __call__(self, rep: StepReport) -> None:
        for out in rep.outputs:
            key = (out.request_id, out.index)
            if out.new_token_ids and not self.engine.has_caller(out.request_id):
                self._unsent[key] = self._unsent.get(key, 0) + len(out.new_token_ids)
                _trim(self._unsent, self.keep)  # an engine that died ends none of them
            if out.finished:
                self._endings[key] = Ending(out.embedding is not None, out.num_prompt_tokens,
                                            self._unsent.pop(key, 0))
                _trim(self._endings, self.keep)

    def get(self, request_id: str, index: int) -> Ending | None:
        """How a sequence ended; None when it is not among the last KEEP endings."""
        return self._endings.get((request_id, index))


def _trim(notes: dict, keep: int) -> None:
    while len(notes) > keep:
        del notes[next(iter(notes))]
