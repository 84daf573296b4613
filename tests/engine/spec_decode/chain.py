"""A tiny Markov-chain "model" for exactness tests: the target's next-token
distribution depends on the previous token (BOS = V at the start), and the emitted
sequence of a speculative decode must follow the chain exactly."""
from __future__ import annotations

import torch

from kvserve.engine.sampling.rejection import GeneratorCheckpoints, rejection_sample


def run_chain(p_table, *, draft, num_samples, length, max_k, seed, seeded_rows=False,
              coupled=False, q_table=None):
    """Decode `num_samples` sequences of `length` tokens in parallel, speculatively:
    each step proposes 0..max_k drafts per row (draft="model": x_j ~ q(. | x_{j-1});
    draft="ngram": deterministic x_j = (x_{j-1} + 1) % V) and verifies them.
    seeded_rows: every other row has its own generator; coupled: those rows draw
    through GeneratorCheckpoints (the sampler-noise path of deterministic drafts).
    Returns [num_samples, length] int64."""
    vocab = p_table.shape[1]
    rng = torch.Generator().manual_seed(seed)
    out = torch.full((num_samples, length), -1, dtype=torch.long)
    count = torch.zeros(num_samples, dtype=torch.long)
    gens = [torch.Generator().manual_seed(seed * 100003 + i) if i % 2 == 0 else None
            for i in range(num_samples)] if seeded_rows else None
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        while bool((count < length).any()):
            rows = torch.nonzero(count < length).squeeze(1)
            n = rows.numel()
            prev = torch.where(count[rows] > 0,
                               out[rows, (count[rows] - 1).clamp_min(0)],
                               torch.full((n,), vocab))
            num_draft = torch.randint(0, max_k + 1, (n,), generator=rng)
            drafts, contexts = [], [prev]
            for _ in range(max_k):
                last = contexts[-1]
                if draft == "model":
                    x = torch.multinomial(q_table[last], 1, generator=rng).squeeze(1)
                else:
                    x = (last + 1) % vocab
                drafts.append(x)
                contexts.append(x)
            draft_ids = torch.stack(drafts, 1)
            target = torch.stack([p_table[c] for c in contexts], 1)  # [n, K + 1, V]
            q = torch.stack([q_table[c] for c in contexts[:-1]], 1) \
                if draft == "model" else None
            row_gens = [gens[int(r)] for r in rows] if gens else [None] * n
            checkpoints = GeneratorCheckpoints() if coupled else None
            tokens, accepted = rejection_sample(target, draft_ids, num_draft, [False] * n,
                                                row_gens, draft_probs=q,
                                                checkpoints=checkpoints)
            assert bool((accepted <= num_draft).all())
            for j in range(max_k + 1):
                put = (j <= accepted) & (count[rows] + j < length)
                out[rows[put], count[rows[put]] + j] = tokens[put, j]
            count[rows] += (accepted + 1).clamp_max(length - count[rows])
    return out


def chain_probabilities(p_table, length):
    """[V ** length] exact probabilities of each sequence (row-major index)."""
    vocab = p_table.shape[1]
    probs = p_table[vocab].double()
    for _ in range(length - 1):
        # The last token of prefix i is i % V.
        step = p_table[:vocab].double().repeat(probs.numel() // vocab, 1)
        probs = (probs.unsqueeze(-1) * step).reshape(-1)
    return probs.reshape(-1)


def chi_square_p(samples, p_table, length, min_expected=5.0):
    """p-value of a chi-square test of the sequences against the chain. Cells with
    expected count below min_expected are pooled; zero-probability cells must be
    empty (asserted)."""
    vocab = p_table.shape[1]
    index = torch.zeros(samples.shape[0], dtype=torch.long)
    for j in range(length):
        index = index * vocab + samples[:, j]
    observed = torch.bincount(index, minlength=vocab ** length).double()
    expected = chain_probabilities(p_table, length) * samples.shape[0]
    assert observed[expected == 0].sum() == 0, "a sequence of probability 0 came out"
    small = (expected > 0) & (expected < min_expected)
    big = expected >= min_expected
    obs = torch.cat([observed[big], observed[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         stat / 2))
