"""The engine's one owner of grammar state: each constrained request's compiled
grammar, and a matcher per sequence (a fork's siblings each get their own, from the
grammar's start, since they sample their first token together with the parent).

Per step: `masks` fills the bitmask of the rows whose sequences are constrained (a
free row costs nothing) and the sampler applies it to those rows' logits; `accept`
advances a sequence's matcher by the token it got. A matcher that allows no token at
all (the grammar dead-ends) fails its request alone.

Speculative steps: `verification_masks` checks a sequence's drafts against its
grammar (they are cut before the first one it refuses), fills the mask of each row
that verifies them by walking the matcher through them, and rolls it back; the
tokens that verification emits are then accepted as any others."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr

from kvserve.engine.structured.cpu_mask import apply_bitmask_cpu_
from kvserve.engine.structured.grammars import Grammar, Matcher
from kvserve.scheduler.request import Request

DEAD_END = "the structured output's grammar allows no next token"
REJECTED = "the sampled token does not match the structured output's grammar"


@dataclass
class StepMasks:
    rows: list[int]  # the constrained rows of the step's sampling sequences
    bitmask: torch.Tensor  # [sequences, ceil(V / 32)] int32 on the host; rows filled
    dead: list[int]  # rows with nothing allowed

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """logits with the constrained rows masked, in place: no copy of the rows (at
        16 rows x 49k that was half the masking's cost on CPU). Masking twice (a
        fault isolation's retry) changes nothing."""
        if not self.rows:
            return logits
        if logits.device.type == "cpu":
            apply_bitmask_cpu_(logits, self.bitmask, self.rows)
        else:
            xgr.apply_token_bitmask_inplace(logits, self.bitmask.to(logits.device,
                                                                    non_blocking=True),
                                            indices=self.rows)
        return logits


class Matchers:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._grammars: dict[str, Grammar] = {}  # by group (request) id
        self._matchers: dict[str, Matcher] = {}  # by sequence id

    def start(self, request_id: str, grammar: Grammar) -> None:
        self._grammars[request_id] = grammar

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)
        self._grammars.pop(seq_id, None)

    def tracks(self, seq: Request) -> bool:
        return seq.request_id in self._matchers or seq.group_id in self._grammars

    def _matcher(self, seq: Request) -> Matcher:
        m = self._matchers.get(seq.request_id)
        if m is None:
            m = self._matchers[seq.request_id] = self._grammars[seq.group_id].matcher()
        return m

    def masks(self, seqs: list[Request]) -> StepMasks | None:
        """The step's masks, None when no sequence is constrained."""
        rows = [j for j, q in enumerate(seqs) if q.params.structured is not None]
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)
        masked, dead = [], []
        for j in rows:
            matcher = self._matcher(seqs[j])
            if matcher.is_terminated() and not seqs[j].params.ignore_eos:
                continue  # it ends with the step before (async scheduling planned this one)
            masked.append(j)
            if not self._fill(matcher, bitmask, j):  # a dead end, or past its end token
                dead.append(j)
        return StepMasks(masked, bitmask, dead)

    def verification_masks(self, seqs: list[Request], drafts: list[list[int]]
                           ) -> tuple[list[list[int]], StepMasks | None]:
        """For sequences verifying drafts: each one's drafts, cut before the first its
        grammar refuses, one that ends it or one after which it allows nothing (a
        free sequence's stay whole); and the masks of the rows that verify them
        (k + 1 per sequence, in order, with the cut drafts' rows gone). `dead` holds
        sequences (indices) whose grammar allows nothing now: their rows stay
        unmasked, for the caller to fail them. Every matcher ends where it began."""
        if all(q.params.structured is None for q in seqs):
            return drafts, None
        bitmask = xgr.allocate_token_bitmask(sum(len(d) + 1 for d in drafts), self.vocab_size)
        kept, rows, dead, at = [], [], [], 0
        for i, (q, d) in enumerate(zip(seqs, drafts)):
            if q.params.structured is None:
                kept.append(d)
                at += len(d) + 1
                continue
            n = self._walk(self._matcher(q), d, bitmask, at)
            if n < 0:
                dead.append(i)
                n = 0
            else:
                rows += range(at, at + n + 1)
            kept.append(d[:n])
            at += n + 1
        return kept, StepMasks(rows, bitmask[:at], dead)

    @staticmethod
    def _walk(matcher: Matcher, drafts: list[int], bitmask: torch.Tensor,
              at: int) -> int:
        """Fills rows at.. with the masks before each draft and after the last one
        kept; returns how many are kept (-1: nothing is allowed now)."""
        if not Matchers._fill(matcher, bitmask, at):
            return -1
        n = 0
        for token in drafts:
            if not matcher.accept_token(int(token)):
                break
            # Its end token is sampled, never drafted; nor is one leading nowhere.
            if not Matchers._fill(matcher, bitmask, at + n + 1):
                matcher.rollback(1)
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    @staticmethod
    def _fill(matcher: Matcher, bitmask: torch.Tensor, row: int) -> bool:
        """Fills the row with what the matcher allows next; False when that is
        nothing (its end token taken, or the grammar dead-ends)."""
        if matcher.is_terminated():
            bitmask[row] = 0
            return False
        matcher.fill_next_token_bitmask(bitmask, row)
        return bool(bitmask[row].any())

    def accept(self, seqs: list[Request], tokens: dict[str, int | list[int]]) -> dict[str, str]:
        """Each constrained sequence's matcher takes its new token(s); returns the
        sequences (by id) whose token the grammar refused, with the reason. A
        released sequence (async scheduling ran a step for it after its last) is
        passed over."""
        refused = {}
        for q in seqs:
            new = tokens.get(q.request_id)
            if q.params.structured is None or new is None or not self.tracks(q):
                continue  # free, no token, or released (it ended while its step ran)
            matcher = self._matcher(q)
            for token in new if isinstance(new, list) else [new]:
                if not matcher.accept_token(int(token)):
                    refused[q.request_id] = REJECTED
                    break
        return refused
