"""Verification of draft tokens by the modified rejection sampling rule, batched.

Row r has num_draft[r] = k draft tokens x_1..x_k, target distributions p_1..p_{k+1}
(already through temperature, min-p, top-k and top-p: see `target_probs`) and, for a
stochastic draft, draft distributions q_1..q_k. x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)), in order; at the first rejection a token is drawn from
normalize(max(0, p_i - q_i)) and the row stops; if all k are accepted a bonus token
is drawn from p_{k+1}. The emitted tokens then follow the target exactly. Greedy
rows accept while x_i is the argmax of p_i and emit the argmax at the first mismatch
(or the bonus argmax); they draw no random numbers.

Deterministic drafts (n-gram, `draft_probs=None`: q_i is one-hot at x_i): x_i is
accepted with probability p_i(x_i), and a rejection draws from p_i without x_i; no
[K, V] draft tensor is built. A row draws k + 1 uniforms: k for the tests, one for
the token drawn at the end (engine/sampling/draw.py, as a step without speculation
draws its token).

Seeded rows of a deterministic draft may instead (with `GeneratorCheckpoints`) draw
y_i ~ p_i at every position exactly as the engine's sampler draws a token (`draw`:
one uniform per position from the request's generator) and accept x_i iff
y_i == x_i, emitting y_i at the first mismatch. That is the same rule
(P(accept) = p_i(x_i); y_i given y_i != x_i is p_i without x_i, renormalised), and
a request that rewinds its generator to the state after its last emitted token
consumes exactly the numbers it would have without speculation, so it emits the
same tokens given the same target probabilities.

Nothing here syncs with the host: the results are device tensors, for one transfer."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.platform.host_copy import to_device
from kvserve.engine.sampling.draw import draw, pick
from kvserve.engine.sampling.sample import _probabilities
from kvserve.scheduler.sampling_params import SamplingParams

PAD = -1


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[N, V] float32: the distribution the engine's sampler draws row i from, given
    its adjusted logits (min-tokens mask, logit_bias and penalties already applied,
    as `LogitAdjustments.apply` does). Random rows: temperature, min-p, top-k, top-p
    and softmax, by the sampler's own code; greedy rows: one-hot at the argmax."""
    probs = torch.zeros_like(logits, dtype=torch.float32)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = _long(greedy, logits.device)
        probs[rows, logits[rows].argmax(dim=-1)] = 1.0
    if random_rows:
        rows = _long(random_rows, logits.device)
        probs[rows] = _probabilities(logits[rows].float(), [params[i] for i in random_rows])
    return probs


def verification_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                       num_draft: Sequence[int]) -> torch.Tensor:
    """logits: [sum(k_r + 1), V], request r's k_r + 1 verification rows in order (all
    adjusted). Returns [R, K + 1, V] (K = max k_r) for `rejection_sample`; a row's
    positions past k_r are zeros."""
    repeated = [p for p, k in zip(params, num_draft) for _ in range(k + 1)]
    return pad_positions(target_probs(logits, repeated), num_draft)


def pad_positions(flat: torch.Tensor, num_draft: Sequence[int]) -> torch.Tensor:
    """[sum(k_r + 1), ...] -> [R, K + 1, ...], zero-padded."""
    width = max(num_draft, default=0) + 1
    dest = [r * width + j for r, k in enumerate(num_draft) for j in range(k + 1)]
    out = flat.new_zeros((len(num_draft) * width, *flat.shape[1:]))
    out[_long(dest, flat.device)] = flat
    return out.view(len(num_draft), width, *flat.shape[1:])


def pad_drafts(drafts: Sequence[Sequence[int]],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request draft lists -> (draft_token_ids [R, K] int64 padded with 0,
    num_draft [R] int64)."""
    width = max((len(d) for d in drafts), default=0)
    ids = [list(d) + [0] * (width - len(d)) for d in drafts]
    return (to_device(ids, torch.long, device).view(len(drafts), width),
            _long([len(d) for d in drafts], device))


class GeneratorCheckpoints:
    """For the seeded rows of a deterministic-draft verification: each generator's
    state after drawing for positions 0..K. After the host learns how many
    tokens a row emitted (num_accepted + 1), `rewind` sets its generator to the state
    after that many draws, as if it had sampled them one step at a time. Skipping
    `rewind` is also correct (the draws are merely not shared with the
    non-speculative path), so it is optional."""

    def __init__(self):
        self._states: dict[int, tuple[torch.Generator, list[torch.Tensor]]] = {}

    def record(self, row: int, gen: torch.Generator) -> None:
        self._states.setdefault(row, (gen, []))[1].append(gen.get_state())

    def rewind(self, num_emitted: Sequence[int]) -> None:
        """num_emitted[r]: the tokens row r emitted (host ints)."""
        for row, (gen, states) in self._states.items():
            gen.set_state(states[num_emitted[row] - 1])


def rejection_sample(target: torch.Tensor, draft_token_ids: torch.Tensor,
                     num_draft: torch.Tensor | Sequence[int], greedy: Sequence[bool],
                     generators: Sequence[torch.Generator | None],
                     draft_probs: torch.Tensor | None = None,
                     checkpoints: GeneratorCheckpoints | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """target: [R, K + 1, V] target probabilities (row r: positions 0..k_r valid);
    draft_token_ids: [R, K] int64 (entries past k_r ignored, any value); num_draft:
    [R] k_r (tensor or host ints); greedy: [R] host bools; generators: [R] (None: the
    default generator; ignored for greedy rows); draft_probs: [R, K, V] or None for a
    deterministic (one-hot) draft. checkpoints (deterministic drafts only): seeded
    random rows then draw as the sampler does, position by position, and record their
    generator states (see GeneratorCheckpoints); without it every random row takes
    the ratio test, which draws k + 1 uniforms.

    Returns (tokens [R, K + 1] int64: row r's emitted tokens in 0..num_accepted[r],
    PAD (-1) after; num_accepted [R] int64: accepted draft tokens, so a row emits
    num_accepted + 1 tokens)."""
    num_rows, width, _ = target.shape
    dev = target.device
    if not torch.is_tensor(num_draft):
        num_draft = _long(list(num_draft), dev)
    positions = torch.arange(width, device=dev)
    in_draft = positions[:width - 1].unsqueeze(0) < num_draft.unsqueeze(1)  # [R, K]
    coupled = [] if draft_probs is not None or checkpoints is None else \
        [r for r, g in enumerate(generators) if g is not None and not greedy[r]]
    chosen, num_accepted = _ratio_test(target, draft_token_ids, draft_probs, in_draft,
                                       greedy, generators, skip=set(coupled))
    if coupled:
        rows = _long(coupled, dev)
        raced = _race(target[rows], [generators[r] for r in coupled], coupled, checkpoints)
        matched = (raced[:, :width - 1] == draft_token_ids[rows]) & in_draft[rows]
        chosen[rows] = raced
        num_accepted[rows] = _prefix_length(matched)
    tokens = torch.where(positions.unsqueeze(0) <= num_accepted.unsqueeze(1), chosen,
                         torch.full_like(chosen, PAD))
    return tokens, num_accepted


def _race(target: torch.Tensor, generators: list[torch.Generator], rows: list[int],
          checkpoints: GeneratorCheckpoints) -> torch.Tensor:
    """[n, K + 1]: a token drawn from each position's target as the sampler draws
    one (`pick`), each position's uniform drawn from the row's generator in order,
    states recorded."""
    u = torch.empty(target.shape[:2], dtype=torch.float32, device=target.device)
    for j, (gen, row) in enumerate(zip(generators, rows)):
        for pos in range(target.shape[1]):
            u[j, pos].uniform_(generator=gen)
            checkpoints.record(row, gen)
    return pick(target, u)


def _ratio_test(target, draft_token_ids, draft_probs, in_draft, greedy, generators, skip):
    """The rule itself, for every row but `skip` (whose results are left unset):
    (chosen [R, K + 1] with the draft tokens, then the recovered or bonus token at
    num_accepted; num_accepted [R]). draft_probs None: q one-hot at the drafts."""
    num_rows, width, _ = target.shape
    dev = target.device
    draft = torch.where(in_draft, draft_token_ids, 0)  # padding may be junk
    p_x = target[:, :width - 1].gather(2, draft.unsqueeze(-1)).squeeze(-1)
    random_rows = [r for r, g in enumerate(greedy) if not g and r not in skip]
    uniform = _uniforms((num_rows, width - 1), target.dtype, dev, random_rows, generators)
    if draft_probs is None:
        accept = uniform < p_x  # min(1, p / 1)
    else:  # u < p / q without dividing; q(x) == 0 (never drawn) accepts if p(x) > 0
        accept = uniform * draft_probs.gather(2, draft.unsqueeze(-1)).squeeze(-1) < p_x
    greedy_rows = torch.tensor(list(greedy), dtype=torch.bool).to(dev)
    argmax = target.argmax(dim=-1)  # [R, K + 1]
    accept = torch.where(greedy_rows.unsqueeze(1), argmax[:, :width - 1] == draft_token_ids,
                         accept) & in_draft
    num_accepted = _prefix_length(accept)
    last = argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    if random_rows:
        rows = _long(random_rows, dev)
        residual = _residual(target[rows], draft[rows], draft_probs, in_draft[rows],
                             num_accepted[rows], rows)
        last[rows] = draw(residual, [generators[r] for r in random_rows])
    padded = torch.cat([draft, draft.new_zeros((num_rows, 1))], dim=1)
    positions = torch.arange(width, device=dev).unsqueeze(0)
    chosen = torch.where(positions == num_accepted.unsqueeze(1), last.unsqueeze(1), padded)
    return chosen, num_accepted


def _residual(target, draft, draft_probs, in_draft, num_accepted, rows):
    """[n, V] unnormalised: max(0, p - q) at the first rejection, p at the bonus (q is
    zero there). `draw` draws from it without normalising."""
    num_rows, width, vocab = target.shape
    at = num_accepted.view(num_rows, 1, 1).expand(num_rows, 1, vocab)
    p_stop = target.gather(1, at).squeeze(1)
    rejected = num_accepted < in_draft.sum(dim=1)  # stopped before the bonus
    if draft_probs is None:
        x_stop = torch.cat([draft, draft.new_zeros((num_rows, 1))], dim=1).gather(
            1, num_accepted.unsqueeze(1))
        drop = torch.zeros_like(p_stop).scatter_(1, x_stop, 1.0) * rejected.unsqueeze(1)
        residual = p_stop * (1 - drop)
    else:
        q = draft_probs[rows] * in_draft.unsqueeze(-1)
        q_pad = torch.cat([q, q.new_zeros((num_rows, 1, vocab))], dim=1)
        residual = (p_stop - q_pad.gather(1, at).squeeze(1)).clamp_min_(0)
    # Nothing left (p <= q everywhere: a rejection had probability 0): fall back to p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p_stop, residual)


def _uniforms(shape, dtype, device, random_rows, generators) -> torch.Tensor:
    """[R, K] U[0, 1): seeded rows from their own generator, the rest from the
    default one (values of rows outside random_rows are unused)."""
    if not random_rows:
        return torch.zeros(shape, dtype=dtype, device=device)
    uniform = torch.rand(shape, dtype=dtype, device=device)
    for r in random_rows:
        if generators[r] is not None:
            uniform[r].uniform_(generator=generators[r])
    return uniform


def _prefix_length(accept: torch.Tensor) -> torch.Tensor:
    """[R, K] bool -> [R] int64: the accepted prefix, up to the first False."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)
