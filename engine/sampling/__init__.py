"""Sampling: logits processors, the sampler, logprobs and prompt logprobs, and the
verification of speculative drafts (verify.py, rejection.py, verify_positions.py)."""
from kvserve.engine.sampling.sample import sample
from kvserve.engine.sampling.sampler import Sampler, StepResult

__all__ = ["Sampler", "StepResult", "sample"]
