"""One step's sampling for the model runner: the sequences that sample (a forking
parent samples for its siblings from its own row), their logits adjustments, the
tokens, and the logprobs and prompt logprobs of the requests that ask for them, all
brought to the host with one transfer. Keeps each seeded request's generator and
each request's prompt logprobs between steps.

A fault stays with its request: a row whose raw logits hold NaN or +inf (or are all
-inf) fails that request instead of sampling it, and an exception while sampling
fails the requests it is raised for (found by sampling each alone) while the others
get the tokens they would have got without them (see Sampler.run).

Rows of constrained requests (structured outputs) are masked by their grammar
before sampling, and their matchers take the tokens once they reach the host
(engine/structured/matchers.py)."""
from __future__ import annotations

import torch

from kvserve.engine.platform import faults
from kvserve.engine.platform.host_copy import to_device
from kvserve.engine.sampling.adjustments import build_adjustments
from kvserve.engine.sampling.logprobs import decode_block, logprob_block, raw_logprobs
from kvserve.engine.sampling.peaks import row_peaks
from kvserve.engine.sampling.prompt_logprobs import PromptLogprobs, PromptSpan
from kvserve.engine.sampling.sample import sample
from kvserve.engine.sampling.step_logits import StepLogits
from kvserve.engine.sampling.step_result import (NON_FINITE, SampleLaunch, StepResult, drop_dead,
                                                 drop_failed, only, scheduled_ids)
from kvserve.engine.sampling.verify import verify as verify_drafts
from kvserve.engine.structured.matchers import DEAD_END, Matchers
from kvserve.scheduler.output import ScheduledRequest
from kvserve.scheduler.request import Request


class Sampler:
    def __init__(self, device: torch.device, matchers: Matchers | None = None,
                 advances_matchers: bool = True):
        self.device = device
        self.prompt = PromptLogprobs()
        self._generators: dict[str, torch.Generator] = {}
        # Structured outputs' grammar state: the engine's, where it has a tokenizer.
        # A scratch sampler (fault isolation's probes) masks with it, so a request's
        # grammar fault is found as its own, but never advances it.
        self.matchers = matchers
        self._advances_matchers = advances_matchers

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.prompt.release(request_id)
        if self.matchers is not None:
            self.matchers.release(request_id)

    def launch(self, logits: StepLogits, sampling: list[ScheduledRequest],
               spans: list[PromptSpan], before: SampleLaunch | None = None) -> SampleLaunch:
        """The device half of run(): the tokens drawn and their copy to the host
        started, nothing waited for. A fault here is isolated at once (the launch
        then carries its finished result). before: the step before, not finished
        yet (async scheduling), whose tokens this step's grammar masks build on."""
        if before is not None:
            self._catch_up(before)
        # Seeded generators as they were before the step: a retry without a failing
        # request must draw the same numbers again (empty, and free, without seeds).
        saved = {rid: g.get_state() for rid, g in self._generators.items()}
        try:
            return self._launch(logits, sampling, spans)
        except Exception as exc:  # noqa: BLE001 - blamed on requests, or re-raised
            result = self._isolate(exc, logits, sampling, spans, saved)
            return SampleLaunch(sampling, spans, *_sequences(sampling), result=result)

    def finish(self, launch: SampleLaunch) -> StepResult:
        """The host half: waits for the launch's transfer and decodes it. A fault
        here (host-side work only) is blamed by finishing each request alone."""
        try:
            return self._finish(launch)
        except Exception as exc:  # noqa: BLE001 - blamed on requests, or re-raised
            owners = _owners(launch.sampling, launch.spans)
            failed = faults.blame(exc, owners,
                                  lambda rid: self._scratch()._finish(launch, {rid}),
                                  "sampling")
            keep = set(owners) - failed.keys()
            result = self._finish(launch, keep) if keep else StepResult()
            result.failed.update(failed)
            return result

    def _run(self, logits: StepLogits, sampling: list[ScheduledRequest],
             spans: list[PromptSpan]) -> StepResult:
        """One attempt, both halves, faults propagating (for _isolate)."""
        return self._finish(self._launch(logits, sampling, spans))

    def _launch(self, logits: StepLogits, sampling: list[ScheduledRequest],
                spans: list[PromptSpan]) -> SampleLaunch:
        seqs, rows = _sequences(sampling)
        step_logits = logits.sample
        top, bad = _peaks(step_logits)
        if len(rows) != len(sampling):
            picked = _index(rows, step_logits.device)
            step_logits, top = step_logits[picked], top[picked]
        want = [j for j, q in enumerate(seqs) if q.params.logprobs is not None]
        # Before sampling: logprobs come from the raw logits.
        raw = raw_logprobs(step_logits[_index(want, self.device)]) if want else None
        masks = self.matchers.masks(seqs) if self.matchers is not None and seqs else None
        if masks is not None:  # after the logprobs: those are the model's own
            step_logits, top = masks.apply_(step_logits), None
        tokens = self._sample(step_logits, seqs, top)
        launch = SampleLaunch(sampling, spans, seqs, rows, tokens, want=want,
                              dead=masks.dead if masks is not None else [])
        transfer = launch.transfer
        if seqs:
            transfer.add(tokens)
            transfer.add(bad)
        launch.k_out = max((seqs[j].params.logprobs for j in want), default=0)
        if raw is not None:
            transfer.add(logprob_block(raw, tokens[_index(want, self.device)], launch.k_out))
        launch.k_prompt = max((s.request.params.prompt_logprobs for s in spans), default=0)
        if spans:
            targets = _index([t for s in spans for t in s.targets], self.device)
            transfer.add(logprob_block(raw_logprobs(logits.prompt), targets,
                                       launch.k_prompt))
        transfer.start()
        return launch

    @faults.fault_point("decode", lambda self, launch, keep=None: _decoded(launch, keep))
    def _finish(self, launch: SampleLaunch, keep: set[str] | None = None) -> StepResult:
        """The launch's result, for the requests in `keep` only if given. Everything
        that can raise comes before the one change to the sampler's state that a
        retry could not undo (prompt logprobs handed over)."""
        if launch.result is not None:
            return launch.result
        seqs, sampling, spans = launch.seqs, launch.sampling, launch.spans
        parts = iter(launch.transfer.fetch())
        token_list = [int(t) for t in next(parts)] if seqs else []
        bad_rows = next(parts) if seqs else []
        result = StepResult(dict(zip(_ids(seqs), token_list)))
        if launch.want:
            chosen = [seqs[j] for j in launch.want]
            items = decode_block(next(parts), [token_list[j] for j in launch.want],
                                 [q.params.logprobs for q in chosen], launch.k_out)
            result.logprobs = {q.request_id: item for q, item in zip(chosen, items)}
        prompt_items = self._prompt_items(next(parts), spans, launch.k_prompt) if spans else []
        if keep is not None:
            result, prompt_items = only(result, launch, prompt_items, keep)
            seqs = [q for q, row in zip(seqs, launch.rows)
                    if sampling[row].request.request_id in keep]
            bad_rows = [flag if s.request.request_id in keep else 0
                        for s, flag in zip(sampling, bad_rows)]
        drop_failed(result, sampling, launch.rows, launch.seqs, bad_rows)
        drop_dead(result, sampling, launch, keep)
        for span, items in prompt_items:
            self.prompt.add(span, items)
        self._hand_over_prompts([s for s in sampling if keep is None
                                 or s.request.request_id in keep], result)
        if self.matchers is not None and self._advances_matchers:  # last: no undo
            refused = self.matchers.accept(seqs, result.tokens) \
                if launch.caught_up is None else launch.caught_up
            refused = {q: why for q, why in refused.items() if q in result.tokens}
            for seq_id in refused:
                result.tokens.pop(seq_id)
            result.failed.update(scheduled_ids(launch, refused))
        return result

    def _catch_up(self, before: SampleLaunch) -> None:
        """The constrained sequences of the unfinished step before take its tokens
        now (read from its transfer, which its own finish reads again), so that this
        step's masks follow them; its finish then accepts nothing twice. A bad row's
        or a dead one's token is no token; a matcher that raises refuses."""
        if (self.matchers is None or not self._advances_matchers
                or before.result is not None or before.caught_up is not None
                or all(q.params.structured is None for q in before.seqs)):
            return
        parts = before.transfer.fetch()
        tokens, bad_rows = parts[0], parts[1]
        before.caught_up = {}
        for j, q in enumerate(before.seqs):
            if q.params.structured is None or bad_rows[before.rows[j]] or j in before.dead:
                continue
            try:
                before.caught_up.update(self.matchers.accept([q], {q.request_id: int(tokens[j])}))
            except Exception as exc:  # noqa: BLE001 - this sequence's grammar fault
                before.caught_up[q.request_id] = f"structured output: {exc}"

    def _isolate(self, exc: Exception, logits: StepLogits,
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
        scratch = Sampler(self.device, self.matchers, advances_matchers=False)
        scratch._generators = {rid: torch.Generator(device=g.device).set_state(g.get_state())
                               for rid, g in self._generators.items()}
        scratch.prompt = self.prompt.copy()
        return scratch

    @faults.fault_point("sample", lambda self, logits, seqs, argmax=None: seqs)
    def _sample(self, logits: torch.Tensor, seqs: list[Request],
                argmax: torch.Tensor | None = None) -> torch.Tensor | None:
        if not seqs:
            return None
        adjustments = build_adjustments(seqs, logits.shape[-1], self.device)
        return sample(logits, [q.params for q in seqs], [self._generator(q) for q in seqs],
                      adjustments, argmax)

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
        result.tokens as a list. A request whose rows hold NaN/inf fails instead.
        A constrained request verifies only the drafts its grammar allows, on rows
        masked by it, and its matcher takes the tokens at once."""
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
        reqs = [s.request for s, _ in ok]
        drafts, masks = [s.spec_token_ids for s, _ in ok], None
        if self.matchers is not None:  # constrained: drafts checked against the grammar
            drafts, masks = self.matchers.verification_masks(reqs, drafts)
        rows = [r for (_, at), d in zip(ok, drafts) for r in range(at, at + len(d) + 1)]
        logits = logits[_index(rows, self.device)]
        if masks is not None:
            logits = masks.apply_(logits)
        emitted = dict(zip(_ids(reqs), verify_drafts(logits, reqs, drafts,
                                                     [self._generator(q) for q in reqs])))
        for i in masks.dead if masks is not None else ():
            del emitted[reqs[i].request_id]
            result.failed[reqs[i].request_id] = DEAD_END
        if self.matchers is not None and self._advances_matchers:
            for seq_id, why in self.matchers.accept(reqs, emitted).items():
                del emitted[seq_id]
                result.failed[seq_id] = why
        result.tokens.update(emitted)

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


def _peaks(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax [R], and [R] int64 that is 1 where a row of raw logits holds
    NaN or +inf or is all -inf: one pass over the logits for both (the max propagates
    NaN, and its index is the first maximal one, as argmax's). Checked before the
    adjustments, whose -infs (min_tokens, logit_bias, top-k) are legitimate."""
    top, peak = row_peaks(logits)
    return top, (~peak.isfinite()).long()


def _non_finite(logits: torch.Tensor) -> torch.Tensor:
    return _peaks(logits)[1]


def _owners(sampling: list[ScheduledRequest], spans: list[PromptSpan]) -> list[str]:
    """The step's requests, by scheduled request id, in row order."""
    return [s.request.request_id for s in sampling] + [s.request.request_id for s in spans]


def _subset(logits: StepLogits, sampling: list[ScheduledRequest],
            spans: list[PromptSpan], keep: set[str]):
    """The arguments of _run() for the requests in `keep` only."""
    sample = [i for i, s in enumerate(sampling) if s.request.request_id in keep]
    prompt, at = [], 0
    for span in spans:
        if span.request.request_id in keep:
            prompt.extend(range(at, at + span.count))
        at += span.count
    return (logits.rows(sample, prompt),
            [s for s in sampling if s.request.request_id in keep],
            [s for s in spans if s.request.request_id in keep])


def _decoded(launch: SampleLaunch, keep: set[str] | None) -> list[Request]:
    """The sequences whose tokens _finish(launch, keep) reads on the host (none when
    the launch already finished at once)."""
    if launch.result is not None:
        return []
    return [q for q, row in zip(launch.seqs, launch.rows)
            if keep is None or launch.sampling[row].request.request_id in keep]


def _ids(seqs: list[Request]) -> list[str]:
    return [q.request_id for q in seqs]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)
