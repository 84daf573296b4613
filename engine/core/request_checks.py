"""Checks of a request against the model's limits, shared by the Engine and by a
front end that talks to an engine in another process (and so has only the limits)."""
from __future__ import annotations

from kvserve.scheduler.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], params: SamplingParams | None,
                  max_model_len: int, vocab_size: int) -> None:
    """Raises ValueError for a prompt (or logit_bias token ids) that can never run."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens but this model's "
                         f"maximum context length is {max_model_len} tokens")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of the vocabulary (0..{vocab_size - 1})")
    bias = params.logit_bias if params is not None else None
    bad = next((t for t in bias or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias: token id {bad} is out of the vocabulary "
                         f"(0..{vocab_size - 1})")
