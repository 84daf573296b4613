"""Sampling: logits processors, the sampler, logprobs and prompt logprobs."""
from engine.sampling.sample import sample
from engine.sampling.sampler import Sampler, StepResult

__all__ = ["Sampler", "StepResult", "sample"]
