"""What a step is on the device: the flat batch the forward pass reads (FlatBatch),
and a launched step whose results the host has not read yet (LaunchedStep)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine.kernels.attention.step_metadata import HostStep
from kvserve.engine.models.lora_step import LoRAStep
from kvserve.engine.platform.host_copy import to_device
from kvserve.engine.runner.pooling import PoolRows
from kvserve.engine.sampling import StepResult
from kvserve.engine.sampling.prompt_logprobs import PromptSpan
from kvserve.engine.sampling.step_logits import LogitRows
from kvserve.engine.sampling.step_result import SampleLaunch
from kvserve.scheduler.output import ScheduledRequest


@dataclass
class LaunchedStep:
    """A step sent to the device whose results the host has not read yet."""
    sample: SampleLaunch | None = None  # None: nobody sampled
    verified: StepResult | None = None  # verifications' results (read at once)
    failed: dict[str, str] = field(default_factory=dict)  # left out at preparation
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # on the device
    # Pipeline stages: the step sent to the first stage, its last stage's layers (and
    # sampling) run when it comes back (ModelRunner.finish), with its block copies.
    staged: tuple[FlatBatch, list[tuple[int, int, int]]] | None = None
    _feed: tuple[torch.Tensor, dict[str, int]] | None = None

    def feed_source(self, device: torch.device) -> tuple[torch.Tensor, dict[str, int]]:
        """The step's sampled tokens on the device and each request's index there:
        what the next step reads its pending tokens from."""
        if self._feed is None:
            launch = self.sample
            ids = [q.request_id for q in launch.seqs] if launch is not None else []
            if launch is not None and launch.result is None:
                tokens = launch.tokens
            else:  # finished on the host at launch (a fault was isolated), or nothing
                done = launch.result.tokens if launch is not None else {}
                tokens = to_device([done.get(rid, 0) for rid in ids], torch.long, device)
            self._feed = tokens, {rid: i for i, rid in enumerate(ids)}
        return self._feed


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: Any  # what the attention backend's prepare made of the step's metadata
    # The hidden rows the model computes logits for, in LogitRows' order: the last
    # row of each request that samples, the prompt rows whose logits prompt logprobs
    # need, the k + 1 rows of each verification
    logit_rows: torch.Tensor
    rows: LogitRows  # how many of each
    sampling: list[ScheduledRequest]  # the requests that sample, in row order
    prompt_spans: list[PromptSpan]  # where the prompt rows come from
    verifying: list[ScheduledRequest]  # requests verifying drafts, in row order
    pooling: list[PoolRows] = field(default_factory=list)  # embedding requests' rows
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # set by the forward
    lora: LoRAStep | None = None  # the step's adapters; None: none of its requests has one
    host: HostStep | None = None  # the host metadata it was built from (tensor parallel)
