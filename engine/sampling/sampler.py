"""One step's sampling for the model runner: the sequences that sample (a forking
parent samples for its siblings from its own row), their logits adjustments, the
tokens, and the logprobs and prompt logprobs of the requests that ask for them, all
brought to the host with one transfer. Keeps each seeded request's generator and
each request's prompt logprobs between steps.

A fault stays with its request: a row whose raw logits hold NaN or +inf (or are all
-inf) fails that request instead of sampling it, and an exception while sampling
fails the requests it is raised for (found by sampling each alone) while the others
get the tokens they would have got without them (see Sampler.run)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine import faults
from engine.outputs import TokenLogprob
from engine.sampling.adjustments import build_adjustments
from engine.sampling.logprobs import (HostTransfer, decode_block, logprob_block,
                                      raw_logprobs)
from engine.sampling.prompt_logprobs import PromptLogprobs, PromptSpan
from engine.sampling.sample import sample
from engine.spec_decode.verify import verify as verify_drafts
from scheduler.output import ScheduledRequest
from scheduler.request import Request

log = logging.getLogger("kvserve.engine")

NON_FINITE = "the model's logits for this request hold NaN/inf values"


@dataclass
class StepResult:
    # request id -> sampled token; for a verification, the accepted drafts and the
    # token after them (a list)
    tokens: dict[str, int | list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # For requests whose prompt (and prompt logprobs) completed this step.
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    # Requests (scheduled request ids: a forking parent stands for its siblings) that
    # failed this step and got no token, with the reason; the engine ends them.
    failed: dict[str, str] = field(default_factory=dict)


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self.prompt = PromptLogprobs()
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.prompt.release(request_id)

    def run(self, logits: torch.Tensor, sampling: list[ScheduledRequest],
            spans: list[PromptSpan]) -> StepResult:
        """logits: the rows of `sampling` in order, then the rows of `spans`."""
        # Seeded generators as they were before the step: a retry without a failing
        # request must draw the same noise again (empty, and free, without seeds).
        saved = {rid: g.get_state() for rid, g in self._generators.items()}
        try:
            return self._run(logits, sampling, spans)
        except Exception as exc:  # noqa: BLE001 - blamed on requests, or re-raised
            return self._isolate(exc, logits, sampling, spans, saved)

    def _run(self, logits: torch.Tensor, sampling: list[ScheduledRequest],
             spans: list[PromptSpan]) -> StepResult:
        """One attempt. Everything that can raise comes before the one change to the
        sampler's state that a retry could not undo (prompt logprobs handed over)."""
        seqs, rows = _sequences(sampling)
        step_logits = logits[:len(sampling)]
        bad = _non_finite(step_logits)
        if len(rows) != len(sampling):
            step_logits = step_logits[torch.tensor(rows, device=logits.device)]
        want = [j for j, q in enumerate(seqs) if q.params.logprobs is not None]
        # Before sampling: logprobs come from the raw logits.
        raw = raw_logprobs(step_logits[_index(want, self.device)]) if want else None
        tokens = self._sample(step_logits, seqs)
        if raw is None and not spans:
            both = torch.cat([tokens, bad]).tolist() if seqs else []
            result, prompt_items = StepResult(dict(zip(_ids(seqs), both))), []
            bad_rows = both[len(seqs):]
        else:
            result, prompt_items, bad_rows = self._gather(
                tokens, bad, seqs, want, raw, logits[len(sampling):], spans)
        if faults.ARMED:
            faults.trip("decode", seqs)
        _drop_failed(result, sampling, rows, seqs, bad_rows)
        for span, items in prompt_items:
            self.prompt.add(span, items)
        self._hand_over_prompts(sampling, result)
        return result

    def _isolate(self, exc: Exception, logits: torch.Tensor,
                 sampling: list[ScheduledRequest], spans: list[PromptSpan],
                 saved: dict[str, torch.Tensor]) -> StepResult:
        """The step's sampling raised. Each request is sampled again alone, on a copy
        of the sampler's state, to find the ones it raises for; those fail, and the
        others are sampled together again from the state before the step (see
        faults.blame for when the fault is the engine's and propagates)."""
        self._rewind(saved)
        owners = _owners(sampling, spans)
        failed = faults.blame(exc, owners, lambda rid: self._scratch()._run(
            *_subset(logits, sampling, spans, {rid})), "sampling")
        keep = set(owners) - failed.keys()
        result = self._run(*_subset(logits, sampling, spans, keep)) if keep else StepResult()
        result.failed.update(failed)
        return result

    def _rewind(self, saved: dict[str, torch.Tensor]) -> None:
        """Generators back to their state before the step; one made during it goes
        (it is made again, from its seed, when next needed)."""
        for rid in list(self._generators):
            if rid in saved:
                self._generators[rid].set_state(saved[rid])
            else:
                del self._generators[rid]

    def _scratch(self) -> Sampler:
        """A sampler with a copy of this one's state: a probe run changes nothing here."""
        scratch = Sampler(self.device)
        scratch._generators = {rid: torch.Generator(device=g.device).set_state(g.get_state())
                               for rid, g in self._generators.items()}
        scratch.prompt = self.prompt.copy()
        return scratch

    def _sample(self, logits: torch.Tensor, seqs: list[Request]) -> torch.Tensor | None:
        if not seqs:
            return None
        if faults.ARMED:
            faults.trip("sample", seqs)
        adjustments = build_adjustments(seqs, logits.shape[-1], self.device)
        return sample(logits, [q.params for q in seqs], [self._generator(q) for q in seqs],
                      adjustments)

    def _gather(self, tokens, bad, seqs, want, raw, prompt_logits, spans):
        """Logprob blocks, tokens and the bad-row flags through one host transfer, then
        decoded: (result, [(span, its prompt logprobs)], bad-row flags)."""
        transfer = HostTransfer()
        if seqs:
            transfer.add(tokens)
            transfer.add(bad)
        k_out = max((seqs[j].params.logprobs for j in want), default=0)
        if raw is not None:
            transfer.add(logprob_block(raw, tokens[_index(want, self.device)], k_out))
        k_prompt = max((s.request.params.prompt_logprobs for s in spans), default=0)
        if spans:
            targets = _index([t for s in spans for t in s.targets], self.device)
            transfer.add(logprob_block(raw_logprobs(prompt_logits), targets, k_prompt))
        parts = iter(transfer.fetch())
        token_list = [int(t) for t in next(parts)] if seqs else []
        bad_rows = next(parts) if seqs else []
        result = StepResult(dict(zip(_ids(seqs), token_list)))
        if raw is not None:
            chosen = [seqs[j] for j in want]
            items = decode_block(next(parts), [token_list[j] for j in want],
                                 [q.params.logprobs for q in chosen], k_out)
            result.logprobs = {q.request_id: item for q, item in zip(chosen, items)}
        prompt_items = self._prompt_items(next(parts), spans, k_prompt) if spans else []
        return result, prompt_items, bad_rows

    @staticmethod
    def _prompt_items(values: list[float], spans: list[PromptSpan], k: int) -> list:
        width, at, out = 2 + 2 * k, 0, []
        for s in spans:
            block = values[at * width:(at + s.count) * width]
            out.append((s, decode_block(block, s.targets,
                                        [s.request.params.prompt_logprobs] * s.count, k)))
            at += s.count
        return out

    def _hand_over_prompts(self, sampling: list[ScheduledRequest], result: StepResult) -> None:
        """Every sequence of a prompt gets its prompt logprobs with its first token."""
        for s in sampling:
            req = s.request
            if req.needs_prompt_logits:
                items = self.prompt.take(req.request_id)
                for seq in (req, *req.pending_forks):
                    result.prompt_logprobs[seq.request_id] = list(items)

    def verify(self, logits: torch.Tensor, items: list[ScheduledRequest],
               result: StepResult) -> None:
        """Speculative steps: each item's k + 1 rows (in order, after the sampling
        rows) decide its accepted drafts and the token after them, which go into
        result.tokens as a list. A request whose rows hold NaN/inf fails instead."""
        bad = _non_finite(logits).tolist()
        ok, at = [], 0
        for s in items:
            width = len(s.spec_token_ids) + 1
            if any(bad[at:at + width]):
                result.failed[s.request.request_id] = NON_FINITE
            else:
                ok.append((s, at))
            at += width
        if not ok:
            return
        rows = [r for s, at in ok for r in range(at, at + len(s.spec_token_ids) + 1)]
        reqs = [s.request for s, _ in ok]
        emitted = verify_drafts(logits[_index(rows, self.device)], reqs,
                                [s.spec_token_ids for s, _ in ok],
                                [self._generator(q) for q in reqs])
        result.tokens.update(zip(_ids(reqs), emitted))

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None or req.params.greedy:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(req.params.seed)
            self._generators[req.request_id] = gen
        return gen


def _sequences(sampling: list[ScheduledRequest]) -> tuple[list[Request], list[int]]:
    """Each sampling request and its siblings about to fork, with its logits row."""
    seqs, rows = [], []
    for row, s in enumerate(sampling):
        for seq in (s.request, *s.request.pending_forks):
            seqs.append(seq)
            rows.append(row)
    return seqs, rows


def _non_finite(logits: torch.Tensor) -> torch.Tensor:
    """[R] int64, 1 where a row of raw logits holds NaN or +inf or is all -inf. One
    reduction (the max propagates NaN); checked before the adjustments, whose -infs
    (min_tokens, logit_bias, top-k) are legitimate."""
    return (~logits.amax(dim=-1).isfinite()).long()


def _drop_failed(result: StepResult, sampling: list[ScheduledRequest], rows: list[int],
                 seqs: list[Request], bad_rows: list) -> None:
    """A request whose row was bad fails (its siblings about to fork with it) and
    keeps no token."""
    bad = {i for i, flag in enumerate(bad_rows) if flag}
    if not bad:
        return
    for i in bad:
        result.failed[sampling[i].request.request_id] = NON_FINITE
    for q, row in zip(seqs, rows):
        if row in bad:
            result.tokens.pop(q.request_id, None)
            result.logprobs.pop(q.request_id, None)
    log.warning("NaN/inf logits for request(s) %s", sorted(result.failed))


def _owners(sampling: list[ScheduledRequest], spans: list[PromptSpan]) -> list[str]:
    """The step's requests, by scheduled request id, in row order."""
    return [s.request.request_id for s in sampling] + [s.request.request_id for s in spans]


def _subset(logits: torch.Tensor, sampling: list[ScheduledRequest],
            spans: list[PromptSpan], keep: set[str]):
    """The arguments of run() for the requests in `keep` only."""
    index = [i for i, s in enumerate(sampling) if s.request.request_id in keep]
    at = len(sampling)
    for span in spans:
        if span.request.request_id in keep:
            index.extend(range(at, at + span.count))
        at += span.count
    return (logits[torch.tensor(index, dtype=torch.long, device=logits.device)],
            [s for s in sampling if s.request.request_id in keep],
            [s for s in spans if s.request.request_id in keep])


def _ids(seqs: list[Request]) -> list[str]:
    return [q.request_id for q in seqs]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
