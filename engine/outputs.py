"""What the engine reports about a request after each step it took part in."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    index: int = 0  # which of the prompt's n sequences (0 for the request itself)
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    # "stop" (EOS or a stop token), "length" (max_tokens or context), "abort", "error"
    finish_reason: str | None = None
    # The token that caused a "stop" finish (None for EOS-free or other reasons).
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when finish_reason == "error"
