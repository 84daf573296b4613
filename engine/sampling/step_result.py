"""What one step's sampling hands back (StepResult), what it leaves in flight between
launch and finish (SampleLaunch), and how a result is trimmed: the requests whose
rows were bad or whose grammar allowed nothing fail, and a retry keeps only some."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvserve.engine.platform.outputs import TokenLogprob
from kvserve.engine.sampling.logprobs import HostTransfer
from kvserve.engine.sampling.prompt_logprobs import PromptSpan
from kvserve.engine.structured.matchers import DEAD_END
from kvserve.scheduler.output import ScheduledRequest
from kvserve.scheduler.request import Request

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
    # Pooling requests whose prompt completed this step: their vectors.
    embeddings: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class SampleLaunch:
    """A step's sampling sent to the device: its tokens there, and the transfer of
    tokens, bad-row flags and logprob blocks to the host started but not read."""
    sampling: list[ScheduledRequest]
    spans: list[PromptSpan]
    seqs: list[Request]  # each sampling request, then its siblings about to fork
    rows: list[int]  # each seq's row in `sampling`
    tokens: torch.Tensor | None = None  # [len(seqs)] on the device
    transfer: HostTransfer = field(default_factory=HostTransfer)
    want: list[int] = field(default_factory=list)  # seqs that asked for logprobs
    dead: list[int] = field(default_factory=list)  # seqs whose grammar allows nothing
    k_out: int = 0
    k_prompt: int = 0
    result: StepResult | None = None  # set when the launch had to finish at once
    # Async scheduling: the next step's masks needed these tokens before this step
    # was finished, so its matchers took them then; the sequences (ids) refused.
    caught_up: dict[str, str] | None = None



def drop_failed(result: StepResult, sampling: list[ScheduledRequest], rows: list[int],
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


def drop_dead(result: StepResult, sampling: list[ScheduledRequest], launch: SampleLaunch,
               keep: set[str] | None) -> None:
    """A sequence whose grammar allowed no token fails its request, with no token."""
    for j in launch.dead:
        owner = sampling[launch.rows[j]].request.request_id
        if keep is None or owner in keep:
            result.failed[owner] = DEAD_END
            result.tokens.pop(launch.seqs[j].request_id, None)


def scheduled_ids(launch: SampleLaunch, reasons: dict[str, str]) -> dict[str, str]:
    """Sequence ids -> the scheduled request that stands for them (a forking parent
    for its siblings), with the reason."""
    out = {}
    for q, row in zip(launch.seqs, launch.rows):
        if q.request_id in reasons:
            out[launch.sampling[row].request.request_id] = reasons[q.request_id]
    return out


def only(result: StepResult, launch: SampleLaunch, prompt_items: list,
          keep: set[str]) -> tuple[StepResult, list]:
    """The parts of a step's result that belong to the requests in `keep` (by
    scheduled request id: a forking parent stands for its siblings)."""
    mine = {q.request_id for q, row in zip(launch.seqs, launch.rows)
            if launch.sampling[row].request.request_id in keep}
    kept = StepResult({r: t for r, t in result.tokens.items() if r in mine},
                      {r: lp for r, lp in result.logprobs.items() if r in mine})
    return kept, [(span, items) for span, items in prompt_items
                  if span.request.request_id in keep]
