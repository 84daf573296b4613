"""A request's state as the scheduler sees it: the tokens it knows (prompt plus
generated) and how many of them already have their KV computed. There are no
prefill/decode phases: each step computes some of the missing tokens."""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from kvserve.scheduler.sampling_params import SamplingParams


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n sequences: its own, then "<id>#1" .. "<id>#n-1"."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams, eos_token_ids: Sequence[int] = (),
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 priority: int = 0, lora: str | None = None, background: bool = False):
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.request_id = request_id
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        # Tokens whose KV is computed, or being computed by a step already scheduled.
        self.num_computed_tokens = 0
        # Tokens sampled by scheduled steps whose results are not back yet (async
        # scheduling plans step N+1 before step N's token is known): they follow
        # token_ids, and the runner feeds them to the model on the device.
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.cache_salt = cache_salt
        self.priority = priority  # lower is sooner (priority policy)
        # A batch job's line (server/batch/): waits behind every interactive request,
        # whatever the policy, and is the first to be preempted (waiting_queue.py).
        self.background = background
        # The LoRA adapter it runs under (the engine's key for it), None: the base model.
        self.lora = lora
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        # The request the client sent, and which of its n sequences this is: what
        # the engine reports it as (its own request_id is the scheduler's).
        self.group_id = request_id
        self.index = 0
        # Siblings that will share this request's blocks once its prompt is computed.
        self.pending_forks: list[Request] = []
        # Speculative drafts for the next step (engine's proposer sets them); the
        # step verifies them alongside the last known token.
        self.spec_token_ids: list[int] = []
        self._stop_ids = set(params.stop_token_ids)
        self.eos_token_ids = tuple(eos_token_ids)
        self._eos_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []  # when each output token was produced
        self.finish_time: float | None = None

    def make_siblings(self) -> None:
        """For n > 1: the other n - 1 sequences, ids "<id>#<i>", seeds offset by i
        so each is reproducible yet different."""
        from dataclasses import replace

        for i, child_id in enumerate(sequence_ids(self.request_id, self.params.n)[1:], 1):
            seed = None if self.params.seed is None else self.params.seed + i
            child = Request(child_id, self.token_ids,
                            replace(self.params, n=1, seed=seed), self.eos_token_ids,
                            self.arrival_time, self.cache_salt, self.priority, self.lora,
                            self.background)
            child.group_id, child.index = self.group_id, i
            self.pending_forks.append(child)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs still to compute: every prompt position needs its logits,
        so no prefix-cache hit (as in vLLM). Once the first token is out they have
        been delivered, and a preempted request may hit the cache again."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must run, so no prefix-cache hit: prompt logprobs
        still to compute, or a mean-pooled embedding (it sums every row)."""
        return self.needs_prompt_logits or (self.params.pooling == "mean"
                                            and self.num_output_tokens == 0)

    @property
    def banned_stop_ids(self) -> tuple[int, ...]:
        """Stop tokens (EOS unless ignore_eos) the sampler masks while fewer than
        min_tokens tokens have been generated; () once they may end the request."""
        if self.num_output_tokens >= self.params.min_tokens:
            return ()
        return tuple(sorted(self._stop_ids | self._eos_ids))

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, max_model_len: int,
                     now: float | None = None) -> None:
        """Add a sampled token (produced at `now`, default: this moment) and decide
        whether the request is done. Runs for every request every step: no
        property hops."""
        tokens = self.token_ids
        tokens.append(token_id)
        self.token_times.append(time.monotonic() if now is None else now)
        n = len(tokens) - self.num_prompt_tokens
        params = self.params
        # As the sampler's mask: a stop token counts once min_tokens others came first.
        if n > params.min_tokens:
            if token_id in self._stop_ids:
                return self.finish("stop", stop_reason=token_id)
            if token_id in self._eos_ids:
                return self.finish("stop")
        if n >= params.max_tokens or len(tokens) >= max_model_len:
            self.finish("length")

    # -- timings (seconds; None until they apply) ----------------------------
    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def queue_time(self) -> float | None:
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled_time is None or not self.token_times:
            return None
        return self.token_times[0] - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if not self.token_times:
            return None
        return self.token_times[-1] - self.token_times[0]

    def finish(self, reason: str, stop_reason: int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()
