"""BlockTableRows keeps each request's block table as a row of one array, updated by
what changed since its last step. Whatever the KV manager did to a table in between
(a block appended, the last block swapped for a private copy, blocks dropped after
rejected drafts, a prompt chunk rewriting it, a readmission after preemption), the
gathered rows must equal the tables, zero-padded."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from kvserve.engine.runner.block_table_rows import BlockTableRows


def item(rid: str, table: list[int], new: int = 1, spec: tuple = ()) -> SimpleNamespace:
    return SimpleNamespace(request=SimpleNamespace(request_id=rid), block_table=table,
                           num_new_tokens=new, spec_token_ids=list(spec))


def padded(tables: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(tables), max(1, *map(len, tables))), dtype=np.int64)
    for row, t in zip(out, tables):
        row[:len(t)] = t
    return out


def test_random_table_changes_are_always_caught():
    rng = random.Random(0)
    rows = BlockTableRows(rows=2, width=2)  # both grow on the way
    tables: dict[str, list[int]] = {}
    next_block = iter(range(1, 10**6))
    for step in range(3000):
        for rid in rng.sample(sorted(tables), k=min(len(tables), rng.randint(0, 2))):
            if rng.random() < 0.5:
                rows.drop(rid)  # finished, or preempted
                del tables[rid]
        while len(tables) < rng.randint(1, 12):
            tables[f"r{step}-{len(tables)}"] = [next(next_block)
                                                for _ in range(rng.randint(1, 5))]
        batch = []
        for rid, t in tables.items():
            kind = rng.random()
            new, spec = 1, ()
            if kind < 0.3:
                t.append(next(next_block))  # a decode opened a block
            elif kind < 0.4:
                t[-1] = next(next_block)  # copy-on-write of the shared last block
            elif kind < 0.5 and len(t) > 1:
                del t[rng.randint(1, len(t) - 1):]  # drafts rejected, blocks back
                t.append(next(next_block))
                new, spec = 1, (7, 8)  # a verification rewrites the row
            elif kind < 0.6:
                t[rng.randrange(len(t))] = next(next_block)  # a chunk writes anywhere
                new = rng.randint(2, 40)
            batch.append((rid, item(rid, t, new, spec)))
        rng.shuffle(batch)
        got = rows.gather([s for _, s in batch])
        assert np.array_equal(got, padded([tables[rid] for rid, _ in batch])), step
