"""The verification half of a step: each speculating request's k + 1 logits rows
(after its last known token and after each draft) decide which drafts stand and
which token follows them, by the rejection rule (rejection.py), with the request's
own penalties, bias and min-tokens mask applied at each position (positions.py)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.sampling.verify_positions import verification_adjustments
from kvserve.engine.sampling.rejection import (GeneratorCheckpoints, pad_drafts, rejection_sample,
                                               verification_probs)
from kvserve.scheduler.request import Request


def verify(logits: torch.Tensor, requests: Sequence[Request],
           drafts: Sequence[Sequence[int]],
           generators: Sequence[torch.Generator | None]) -> list[list[int]]:
    """logits: [sum(k_r + 1), V], request r's rows in order. Returns, per request, the
    accepted drafts followed by one more token (host ints)."""
    adjustments = verification_adjustments(requests, drafts, logits.shape[-1], logits.device)
    if adjustments is not None:
        logits = adjustments.apply(logits)
    params = [r.params for r in requests]
    num_draft = [len(d) for d in drafts]
    target = verification_probs(logits, params, num_draft)
    draft_ids, _ = pad_drafts(drafts, logits.device)
    # Seeded requests draw their numbers as plain decoding would and rewind their
    # generator to the tokens emitted: a seed gives the same text with or without
    # speculation.
    checkpoints = GeneratorCheckpoints()
    tokens, accepted = rejection_sample(target, draft_ids, num_draft,
                                        [p.greedy for p in params], generators,
                                        checkpoints=checkpoints)
    rows, counts = tokens.tolist(), accepted.tolist()
    checkpoints.rewind([a + 1 for a in counts])
    return [row[:a + 1] for row, a in zip(rows, counts)]
