"""Synthetic workloads: lengths, shared prefixes, growing conversations, seeds."""
from __future__ import annotations

import pytest

from kvserve.benchmarks.client.datasets import DatasetSpec, make_sessions
from kvserve.benchmarks.client.history import first_prompt, next_prompt


def length(prompt) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


@pytest.mark.parametrize("token_ids", [False, True])
def test_random_lengths_stay_in_range(token_ids):
    spec = DatasetSpec("random", num_prompts=200, input_len=100, output_len=20,
                       range_ratio=0.25, token_ids=token_ids, vocab_size=50)
    turns = [s.turns[0] for s in make_sessions(spec)]
    assert len(turns) == 200
    for t in turns:
        assert 75 <= t.input_len <= 125 and length(t.message) == t.input_len
        assert 15 <= t.output_len <= 25
    assert len({t.input_len for t in turns}) > 20  # spread, not one value
    if token_ids:
        assert all(0 <= i < 50 for t in turns for i in t.message)


def test_range_ratio_zero_is_exact():
    spec = DatasetSpec("random", num_prompts=10, input_len=33, output_len=7)
    assert {(s.turns[0].input_len, s.turns[0].output_len) for s in make_sessions(spec)} \
        == {(33, 7)}


@pytest.mark.parametrize("token_ids", [False, True])
def test_prefix_groups_share_exactly_their_prefix(token_ids):
    spec = DatasetSpec("prefix", num_prompts=12, input_len=10, prefix_len=40,
                       num_prefixes=3, token_ids=token_ids, vocab_size=100000)
    prompts = [s.turns[0].message for s in make_sessions(spec)]
    heads = [p[:40] if token_ids else p.split()[:40] for p in prompts]
    for i, head in enumerate(heads):
        assert head == heads[i % 3]  # request i uses prefix i % 3
        assert length(prompts[i]) == 50
    assert len({tuple(h) for h in heads}) == 3
    tails = [p[40:] if token_ids else p.split()[40:] for p in prompts]
    assert len({tuple(t) for t in tails}) == 12  # every suffix is its own


@pytest.mark.parametrize("chat", [False, True])
def test_conversation_turns_grow_on_the_previous_ones(chat):
    spec = DatasetSpec("conversation", num_prompts=2, input_len=5, output_len=3, turns=3)
    sessions = make_sessions(spec)
    assert [len(s.turns) for s in sessions] == [3, 3]
    turns = sessions[0].turns
    answers = ["first answer", "second answer"]
    prompts = [first_prompt(turns[0].message, chat)]
    for turn, answer in zip(turns[1:], answers):
        prompts.append(next_prompt(prompts[-1], answer, turn.message, chat))
    for i in (1, 2):
        prev, cur = prompts[i - 1], prompts[i]
        if chat:
            assert cur[:len(prev)] == prev
            assert cur[len(prev):] == [{"role": "assistant", "content": answers[i - 1]},
                                       {"role": "user", "content": turns[i].message}]
        else:
            assert cur == f"{prev}{answers[i - 1]}\n{turns[i].message}"
    assert len(prompts[2]) > len(prompts[1]) > len(prompts[0])


def test_conversation_refuses_token_ids():
    with pytest.raises(ValueError):
        make_sessions(DatasetSpec("conversation", token_ids=True))


@pytest.mark.parametrize("name", ["random", "prefix", "conversation"])
def test_reproducible_by_seed(name):
    spec = DatasetSpec(name, num_prompts=5, input_len=20, output_len=4, range_ratio=0.5,
                       prefix_len=8, seed=7)
    assert make_sessions(spec) == make_sessions(spec)
    other = DatasetSpec(name, num_prompts=5, input_len=20, output_len=4, range_ratio=0.5,
                        prefix_len=8, seed=8)
    assert make_sessions(spec) != make_sessions(other)
