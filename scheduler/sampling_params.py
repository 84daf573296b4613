"""What a request asks of generation. Pure Python: the scheduler reads the stopping
rules, the engine's sampler reads the rest."""
from __future__ import annotations

from dataclasses import dataclass, field

# Below this a temperature is treated as greedy (dividing by it would overflow).
GREEDY_EPSILON = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    n: int = 1  # sequences sampled from one prompt; they share its KV blocks
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0

    def __post_init__(self) -> None:
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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON
