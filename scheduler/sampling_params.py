"""What a request asks of generation. Pure Python: the scheduler reads the stopping
rules, the engine's sampler reads the rest."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.scheduler.structured_output import StructuredOutput

# Below this a temperature is treated as greedy (dividing by it would overflow).
GREEDY_EPSILON = 1e-5
# Most top alternatives a request may ask for per token (OpenAI's and vLLM's cap).
MAX_LOGPROBS = 20
# OpenAI clamps logit_bias values to this range.
MAX_LOGIT_BIAS = 100.0
# How an embedding request's final hidden states become one vector (engine/runner/pooling.py).
POOLING_METHODS = ("last", "mean")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    n: int = 1  # sequences sampled from one prompt; they share its KV blocks
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    # Keep tokens whose probability (after temperature) is >= min_p * the top one's.
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # EOS and stop tokens are masked until this many tokens have been generated.
    min_tokens: int = 0
    # OpenAI: logit -= frequency * count + presence * (count > 0), output tokens only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM/HF, over prompt and output tokens: a seen token's logit is divided by it
    # when positive, multiplied by it otherwise.
    repetition_penalty: float = 1.0
    # token id -> added to its logit (values clamped to [-100, 100]; ids are checked
    # against the vocabulary by the engine).
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled, greedy rows included (all others
    # -inf); None: any. Checked against the vocabulary by the engine.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words as token id sequences (the front end tokenizes the words): a
    # sequence's last token is banned whenever the generated tokens (not the prompt)
    # end with the rest of it; a one-token sequence is banned at every step.
    bad_words_token_ids: list[list[int]] | None = None
    # None: none; k: each sampled token's logprob, rank and the top k alternatives.
    logprobs: int | None = None
    # Same for every prompt token (the first has none).
    prompt_logprobs: int | None = None
    # False: this request never verifies speculative drafts (per-request opt-out).
    speculative: bool = True
    # The output must match this (JSON schema, regex, choice, grammar): the engine
    # masks every token the grammar does not allow.
    structured: StructuredOutput | None = None
    # An embedding request: its prompt's final hidden states pooled this way (one of
    # POOLING_METHODS) are the output; it generates nothing (max_tokens 1, the token
    # thrown away).
    pooling: str | None = None
    # Prefill/decode disaggregation's hand-off (engine/kv_transfer/), as the router
    # sends it: {"do_remote_decode": true} on the prefill instance, the prefill's
    # answer (remote_host, remote_port, transfer_id, ...) on the decode one. Only
    # an engine run with --kv-transfer-config reads it.
    kv_transfer_params: dict | None = None
    # Derived in __post_init__: any penalty, bias, min_tokens, allowed set or bad
    # word to apply to logits; bad_words_token_ids indexed for the sampler.
    needs_processing: bool = field(default=False, init=False, repr=False, compare=False)
    bad_words: BadWords | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_basics()
        self._check_extras()
        self.logit_bias = _clamped_bias(self.logit_bias)
        self.allowed_token_ids = _token_list(self.allowed_token_ids, "allowed_token_ids")
        if self.bad_words_token_ids:
            self.bad_words_token_ids = [_token_list(ids, "bad_words")
                                        for ids in self.bad_words_token_ids]
            self.bad_words = BadWords(self.bad_words_token_ids)
        else:
            self.bad_words_token_ids = None
        self.needs_processing = self.has_penalties or bool(self.logit_bias) \
            or self.min_tokens > 0 or self.allowed_token_ids is not None \
            or self.bad_words is not None

    def _check_basics(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (disabled) or positive")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be non-negative")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError("seed must fit in 64 bits")

    def _check_extras(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be greater than 0")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}")
        if self.pooling is not None:
            if self.pooling not in POOLING_METHODS:
                raise ValueError(f"pooling must be one of {POOLING_METHODS}")
            if self.max_tokens != 1 or self.n != 1:
                raise ValueError("a pooling request generates nothing: max_tokens and n 1")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


class BadWords:
    """bad_words_token_ids indexed for the per-step lookup: the one-token sequences,
    always banned, and the longer ones by the last token of their prefix, so a step
    compares only the sequences whose prefix can end where the output ends."""

    __slots__ = ("always", "after")

    def __init__(self, sequences: list[list[int]]):
        self.always = tuple(sorted({s[0] for s in sequences if len(s) == 1}))
        after: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for s in sequences:
            if len(s) > 1:
                after.setdefault(s[-2], []).append((tuple(s[:-1]), s[-1]))
        self.after = {k: tuple(v) for k, v in after.items()}

    @property
    def reads_output(self) -> bool:
        """Whether what is banned depends on the tokens generated so far."""
        return bool(self.after)

    def banned(self, token_ids: Sequence[int], num_output: int) -> list[int]:
        """The tokens banned after `token_ids`, whose last `num_output` are the
        generated ones (a prefix is matched against those only, as vLLM does)."""
        if not self.after or num_output == 0:
            return list(self.always)
        out = list(self.always)
        for prefix, token in self.after.get(token_ids[-1], ()):
            n = len(prefix)
            if n <= num_output and tuple(token_ids[-n:]) == prefix:
                out.append(token)
        return out


def _token_list(ids, name: str) -> list[int] | None:
    """A list of token ids (non-negative ints; the engine checks the vocabulary), None
    for None; ValueError naming `name` for an empty list or a bad id. A list is kept,
    not copied (a sibling's params share their parent's); the checks are two passes
    over it (a vocabulary's worth of ids: milliseconds)."""
    if ids is None:
        return None
    if not isinstance(ids, list):
        ids = list(ids)
    if not ids:
        raise ValueError(f"{name}: an empty token list")
    if not all(type(t) is int for t in ids) or min(ids) < 0:
        bad = next(t for t in ids if type(t) is not int or t < 0)
        raise ValueError(f"{name}: {bad!r} is not a token id")
    return ids


def _clamped_bias(bias) -> dict[int, float] | None:
    """Integer keys (JSON sends strings), values clamped; None when empty."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: {key!r}: {value!r} is not a token id and a "
                             "number") from None
        if token < 0:
            raise ValueError(f"logit_bias: token id {token} is negative")
        if value != value:
            raise ValueError(f"logit_bias: the bias of token {token} is not a number")
        out[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
    return out
