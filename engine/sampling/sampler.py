"""One step's sampling for the model runner: the sequences that sample (a forking
parent samples for its siblings from its own row), their logits adjustments, the
tokens, and the logprobs and prompt logprobs of the requests that ask for them, all
brought to the host with one transfer. Keeps each seeded request's generator and
each request's prompt logprobs between steps."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprob
from engine.sampling.adjustments import build_adjustments
from engine.sampling.logprobs import (HostTransfer, decode_block, logprob_block,
                                      raw_logprobs)
from engine.sampling.prompt_logprobs import PromptLogprobs, PromptSpan
from engine.sampling.sample import sample
from scheduler.output import ScheduledRequest
from scheduler.request import Request


@dataclass
class StepResult:
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> sampled token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # For requests whose prompt (and prompt logprobs) completed this step.
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)


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
        seqs, rows = _sequences(sampling)
        step_logits = logits[:len(sampling)]
        if len(rows) != len(sampling):
            step_logits = step_logits[torch.tensor(rows, device=logits.device)]
        want = [j for j, q in enumerate(seqs) if q.params.logprobs is not None]
        # Before sampling: logprobs come from the raw logits.
        raw = raw_logprobs(step_logits[_index(want, self.device)]) if want else None
        tokens = self._sample(step_logits, seqs)
        if raw is None and not spans:
            result = StepResult(dict(zip(_ids(seqs), tokens.tolist() if seqs else [])))
        else:
            result = self._gather(tokens, seqs, want, raw, logits[len(sampling):], spans)
        self._hand_over_prompts(sampling, result)
        return result

    def _sample(self, logits: torch.Tensor, seqs: list[Request]) -> torch.Tensor | None:
        if not seqs:
            return None
        adjustments = build_adjustments(seqs, logits.shape[-1], self.device)
        return sample(logits, [q.params for q in seqs], [self._generator(q) for q in seqs],
                      adjustments)

    def _gather(self, tokens, seqs, want, raw, prompt_logits, spans) -> StepResult:
        """Logprob blocks and tokens through one host transfer, then decoded."""
        transfer = HostTransfer()
        if seqs:
            transfer.add(tokens)
        k_out = max((seqs[j].params.logprobs for j in want), default=0)
        if raw is not None:
            transfer.add(logprob_block(raw, tokens[_index(want, self.device)], k_out))
        k_prompt = max((s.request.params.prompt_logprobs for s in spans), default=0)
        if spans:
            targets = _index([t for s in spans for t in s.targets], self.device)
            transfer.add(logprob_block(raw_logprobs(prompt_logits), targets, k_prompt))
        parts = iter(transfer.fetch())
        token_list = [int(t) for t in next(parts)] if seqs else []
        result = StepResult(dict(zip(_ids(seqs), token_list)))
        if raw is not None:
            chosen = [seqs[j] for j in want]
            items = decode_block(next(parts), [token_list[j] for j in want],
                                 [q.params.logprobs for q in chosen], k_out)
            result.logprobs = {q.request_id: item for q, item in zip(chosen, items)}
        if spans:
            self._add_prompt_items(next(parts), spans, k_prompt)
        return result

    def _add_prompt_items(self, values: list[float], spans: list[PromptSpan], k: int) -> None:
        width, at = 2 + 2 * k, 0
        for s in spans:
            block = values[at * width:(at + s.count) * width]
            self.prompt.add(s, decode_block(block, s.targets, [s.request.params.prompt_logprobs]
                                            * s.count, k))
            at += s.count

    def _hand_over_prompts(self, sampling: list[ScheduledRequest], result: StepResult) -> None:
        """Every sequence of a prompt gets its prompt logprobs with its first token."""
        for s in sampling:
            req = s.request
            if req.needs_prompt_logits:
                items = self.prompt.take(req.request_id)
                for seq in (req, *req.pending_forks):
                    result.prompt_logprobs[seq.request_id] = list(items)

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


def _ids(seqs: list[Request]) -> list[str]:
    return [q.request_id for q in seqs]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
