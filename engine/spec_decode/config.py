"""Speculative decoding settings (`--speculative-method`, `--num-speculative-tokens`,
...). Plain data: the engine's config carries one, or None for no speculation."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "early-exit", "draft")

# Above this many running requests the engine stops proposing: a batch this big
# keeps the hardware busy already, and every rejected draft costs a query row.
# bench/spec_decode.py measures where speculation stops paying on a machine.
DEFAULT_DISABLE_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    # ngram (prompt lookup) | early-exit (the target's first layers) | draft (a
    # smaller model with the same vocabulary, at `model`)
    method: str = "ngram"
    num_tokens: int = 4  # drafts verified per request per step (k)
    # No drafts while more requests than this run (0: never switch off).
    disable_batch_size: int = DEFAULT_DISABLE_BATCH_SIZE
    ngram_max: int = 4  # longest suffix matched in the context
    ngram_min: int = 2  # shortest (one token matches too much by chance)
    draft_layers: int = 0  # early-exit: layers the draft runs (0: a quarter)
    model: str | None = None  # draft: the draft model's directory

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
