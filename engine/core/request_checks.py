"""Checks of a request against the model's limits, shared by the Engine and by a
front end that talks to an engine in another process (and so has only the limits)."""
from __future__ import annotations

from kvserve.scheduler.sampling_params import SamplingParams


def check_request(prompt_token_ids: list[int], params: SamplingParams | None,
                  max_model_len: int, vocab_size: int) -> None:
    """Raises ValueError for a prompt (or logit_bias, allowed_token_ids or bad-word
    token ids) that can never run."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens but this model's "
                         f"maximum context length is {max_model_len} tokens")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of the vocabulary (0..{vocab_size - 1})")
    if params is None:
        return
    lists = (("logit_bias", params.logit_bias or ()),
             ("allowed_token_ids", params.allowed_token_ids or ()),
             ("bad_words", [t for ids in params.bad_words_token_ids or () for t in ids]))
    for name, ids in lists:
        if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # min/max: no loop here
            continue
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is out of the vocabulary "
                             f"(0..{vocab_size - 1})")
