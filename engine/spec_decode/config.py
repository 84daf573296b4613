"""Speculative decoding settings (`--speculative-method`, `--num-speculative-tokens`,
...). Plain data: the engine's config carries one, or None for no speculation."""
from __future__ import annotations

from dataclasses import dataclass

from engine.arg_types import non_negative, positive_int
from engine.settings import setting

METHODS = ("ngram", "early-exit", "draft")

# Above this many running requests the engine stops proposing: a batch this big
# keeps the hardware busy already, and every rejected draft costs a query row.
# bench/spec_decode.py measures where speculation stops paying on a machine.
DEFAULT_DISABLE_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    # ngram (prompt lookup) | early-exit (the target's first layers) | draft (a
    # smaller model with the same vocabulary, at `model`); the flag's "none": off
    method: str = setting(
        "ngram", "speculative decoding: ngram (prompt lookup: drafts copied from the "
        "request's own context), early-exit (the model's first --draft-layers layers "
        "draft) or draft (--speculative-model drafts); outputs are unchanged, only "
        "faster", flag="--speculative-method", flag_default="none",
        choices=["none", *METHODS])
    num_tokens: int = setting(4, "drafts verified per request per step",
                              flag="--num-speculative-tokens", parse=positive_int)
    disable_batch_size: int = setting(
        DEFAULT_DISABLE_BATCH_SIZE, "no drafts while more requests than this run: big "
        "batches already use the hardware (0: never switch off)",
        flag="--speculative-disable-batch-size", parse=non_negative(int))
    ngram_max: int = setting(4, "ngram: longest context suffix matched",
                             flag="--ngram-prompt-lookup-max", parse=positive_int)
    # one token matches too much by chance
    ngram_min: int = setting(2, "ngram: shortest context suffix matched",
                             flag="--ngram-prompt-lookup-min", parse=positive_int)
    draft_layers: int = setting(
        0, "early-exit: layers the draft runs (0: a quarter of the model's)",
        parse=non_negative(int))
    model: str | None = setting(
        None, "a smaller model with the same vocabulary that drafts (implies "
        "--speculative-method draft)", flag="--speculative-model")

    @classmethod
    def from_settings(cls, method: str, model: str | None, **rest) -> SpeculativeConfig | None:
        """From the flags: none without a method or a draft model."""
        if method == "none" and model is None:
            return None
        return cls("draft" if model is not None else method, model=model, **rest)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, "
                             f"not {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("a draft model (--speculative-model) goes with the draft "
                             "method, and only with it")
        if self.disable_batch_size < 0 or self.draft_layers < 0:
            raise ValueError("disable_batch_size and draft_layers must be >= 0")
