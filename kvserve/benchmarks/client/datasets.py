"""Synthetic workloads, deterministic for a seed. Every workload is a list of sessions;
a session is one or more turns that run one after another (single-turn datasets have
one turn per session). A prompt is text (a number of words) or, for /v1/completions
with token ids, a list of ids."""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.benchmarks.client.words import random_token_ids, random_words

Prompt = str | list[int]


@dataclass(frozen=True)
class Turn:
    message: Prompt  # the new user text; the whole prompt for a single-turn session
    input_len: int  # words or ids in `message`, what was asked for
    output_len: int  # max_tokens (ignore_eos makes it the length)


@dataclass(frozen=True)
class Session:
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class DatasetSpec:
    name: str = "random"  # random | prefix | conversation
    num_prompts: int = 100  # sessions for `conversation`
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 512
    num_prefixes: int = 4
    turns: int = 3
    token_ids: bool = False
    vocab_size: int = 1000
    seed: int = 0


def sample_len(rng: random.Random, length: int, ratio: float) -> int:
    """Uniform in [length*(1-ratio), length*(1+ratio)], at least 1."""
    low, high = int(length * (1 - ratio)), int(length * (1 + ratio))
    return max(1, rng.randint(low, high))


def _text(rng: random.Random, n: int, spec: DatasetSpec) -> Prompt:
    return random_token_ids(rng, n, spec.vocab_size) if spec.token_ids else random_words(rng, n)


def _join(prefix: Prompt, suffix: Prompt) -> Prompt:
    return prefix + suffix if isinstance(prefix, list) else f"{prefix} {suffix}"


def random_sessions(spec: DatasetSpec, rng: random.Random) -> list[Session]:
    sessions = []
    for _ in range(spec.num_prompts):
        n = sample_len(rng, spec.input_len, spec.range_ratio)
        out = sample_len(rng, spec.output_len, spec.range_ratio)
        sessions.append(Session((Turn(_text(rng, n, spec), n, out),)))
    return sessions


def prefix_sessions(spec: DatasetSpec, rng: random.Random) -> list[Session]:
    """Request i uses prefix i % num_prefixes, then a unique suffix of ~input_len."""
    prefixes = [_text(rng, spec.prefix_len, spec) for _ in range(spec.num_prefixes)]
    sessions = []
    for i in range(spec.num_prompts):
        n = sample_len(rng, spec.input_len, spec.range_ratio)
        out = sample_len(rng, spec.output_len, spec.range_ratio)
        prompt = _join(prefixes[i % spec.num_prefixes], _text(rng, n, spec))
        sessions.append(Session((Turn(prompt, spec.prefix_len + n, out),)))
    return sessions


def conversation_sessions(spec: DatasetSpec, rng: random.Random) -> list[Session]:
    """`turns` user messages per session; the history is added as the session runs
    (see bench.client.history), since it holds the server's answers."""
    if spec.token_ids:
        raise ValueError("conversation prompts are text: the answers come back as text")
    sessions = []
    for _ in range(spec.num_prompts):
        turns = []
        for _ in range(spec.turns):
            n = sample_len(rng, spec.input_len, spec.range_ratio)
            out = sample_len(rng, spec.output_len, spec.range_ratio)
            turns.append(Turn(random_words(rng, n), n, out))
        sessions.append(Session(tuple(turns)))
    return sessions


GENERATORS = {"random": random_sessions, "prefix": prefix_sessions,
              "conversation": conversation_sessions}


def make_sessions(spec: DatasetSpec) -> list[Session]:
    return GENERATORS[spec.name](spec, random.Random(spec.seed))
