"""A step's logits, by what each row is for. The model computes logits for these
rows only, in this order: the last row of each request that samples, then the
prompt rows that prompt logprobs need, then the k + 1 rows of each verification of
k drafts. Each part is named here, so nobody finds it by arithmetic on lengths."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.platform.host_copy import to_device


@dataclass(frozen=True, slots=True)
class LogitRows:
    """How many rows of each kind a step's logits hold."""
    num_sample: int = 0
    num_prompt: int = 0
    num_verify: int = 0

    @property
    def total(self) -> int:
        return self.num_sample + self.num_prompt + self.num_verify


@dataclass(frozen=True, slots=True)
class StepLogits:
    """The sampling and prompt-logprob rows of a step's logits ([R + M, V]), split
    by name. (Verifications' rows go to the verifier apart: `verify_rows`.)"""
    logits: torch.Tensor
    num_sample: int

    @classmethod
    def of(cls, logits: torch.Tensor, rows: LogitRows) -> StepLogits:
        return cls(logits[:rows.num_sample + rows.num_prompt], rows.num_sample)

    @staticmethod
    def verify_rows(logits: torch.Tensor, rows: LogitRows) -> torch.Tensor:
        return logits[rows.num_sample + rows.num_prompt:]

    @property
    def sample(self) -> torch.Tensor:
        """[R, V]: a row per request that samples, in its order."""
        return self.logits[:self.num_sample]

    @property
    def prompt(self) -> torch.Tensor:
        """[M, V]: the prompt rows, span after span."""
        return self.logits[self.num_sample:]

    def rows(self, sample: list[int], prompt: list[int]) -> StepLogits:
        """These sampling rows and these prompt rows only (indices within each)."""
        index = [*sample, *(self.num_sample + i for i in prompt)]
        picked = self.logits[to_device(index, torch.long, self.logits.device)]
        return StepLogits(picked, len(sample))
