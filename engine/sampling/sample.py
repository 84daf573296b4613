"""Turn each row of logits into a token under that request's sampling parameters.

Adjustments (min-tokens mask, logit_bias, penalties) come first, for every row that
asks for them. Greedy rows then take the argmax. Random rows go through temperature,
min_p, top-k and top-p, then `draw` (inverse CDF: exact, and a seeded request draws
from its own generator, so its tokens do not depend on the batch)."""
from __future__ import annotations

import torch

from kvserve.engine.platform.host_copy import to_device
from kvserve.engine.sampling.adjustments import LogitAdjustments
from kvserve.engine.sampling.draw import draw
from kvserve.engine.sampling.peaks import row_peaks
from kvserve.engine.sampling.processors import apply_min_p, apply_top_k, apply_top_p
from kvserve.scheduler.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           adjustments: LogitAdjustments | None = None,
           argmax: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [R, V] float32 (not modified). Returns [R] int64 token ids. argmax:
    the logits' argmax if the caller has it already (the greedy tokens, unless an
    adjustment applies; it may be written to)."""
    if adjustments is not None:
        logits = adjustments.apply(logits)
        argmax = None
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    generators = [generators[i] for i in random_rows]
    if random_rows and len(random_rows) == len(params):  # no argmax, no rows picked out
        return draw(_probabilities(logits, params), generators)
    tokens = row_peaks(logits)[0] if argmax is None else argmax
    if random_rows:
        rows = to_device(random_rows, torch.long, logits.device)
        probs = _probabilities(logits[rows], [params[i] for i in random_rows])
        tokens[rows] = draw(probs, generators)
    return tokens


def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dev = logits.device
    if any(p.temperature != 1.0 for p in params):  # a pass over the logits saved
        temps = to_device([p.temperature for p in params], torch.float32, dev)
        logits = logits / temps.unsqueeze(1)
    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        logits = apply_min_p(logits, to_device(min_ps, torch.float32, dev))
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        logits = apply_top_k(logits, top_ks)
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        logits = apply_top_p(logits, to_device(top_ps, torch.float32, dev))
    return logits.softmax(dim=-1)
