"""What the engine reports about a request after each step it took part in."""
from __future__ import annotations

from dataclasses import dataclass, field


# Slotted: in process mode every step's outputs cross a pipe, and a slotted
# dataclass unpickles 4x faster (0.4 ms instead of 1.5 for 256 outputs), time the
# server's event loop spends every step.
@dataclass(slots=True)
class TokenLogprob:
    """One token's log probability under the model's raw logits (log_softmax before
    temperature, penalties, logit_bias, top-k/p and min-p; vLLM's "raw logprobs")."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token (tokens at least as likely, itself included)
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), best first


@dataclass(slots=True)
class RequestTimes:
    """A finished sequence's timings in the engine (seconds, from the scheduler's
    timestamps; None for a phase it never reached, e.g. aborted while waiting) and
    how many tokens it generated. Plain data: it crosses the pipe in process mode."""

    queue: float | None = None  # arrival in the engine -> first scheduled
    prefill: float | None = None  # first scheduled -> first token
    decode: float | None = None  # first token -> last token
    num_generation_tokens: int = 0

    @classmethod
    def of(cls, req) -> RequestTimes:
        """From a scheduler Request."""
        return cls(req.queue_time, req.prefill_time, req.decode_time, req.num_output_tokens)


@dataclass(slots=True)
class RequestOutput:
    request_id: str  # the request as added; its n sequences tell apart by index
    index: int = 0  # which of the request's n sequences
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    # "stop" (EOS or a stop token), "length" (max_tokens or context), "abort", "error"
    finish_reason: str | None = None
    # The token that caused a "stop" finish (None for EOS-free or other reasons).
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when finish_reason == "error"
    # One per new_token_ids entry when the request asked for logprobs, else None.
    logprobs: list[TokenLogprob] | None = None
    # Only on a sequence's first output with tokens, when it asked for prompt_logprobs:
    # one per prompt token, the first None (nothing precedes it). Every one of the n
    # sequences of a prompt gets the same list.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Only on a sequence's finishing output: its timings, for the request histograms.
    times: RequestTimes | None = None
    # Only on a pooling request's finishing output: its unit-length vector.
    embedding: list[float] | None = None
    # Only on a prefill instance's finishing output of a request that asked for
    # do_remote_decode: where the decode instance reads its KV (engine/kv_transfer/).
    kv_transfer_params: dict | None = None
    # With finish_reason "error": the HTTP status the failure is, where it is not
    # ours (400: the request's own spec, e.g. a grammar past
    # --grammar-compile-timeout; 503: busy); None: the engine's fault (500).
    error_status: int | None = None
