#!/usr/bin/env python
"""Host time to build one step's flat-batch metadata (positions, slots, padded block
tables) for 256 decodes, at several context lengths: from the block tables as lists
(padded anew every step, as before engine/runner/block_table_rows.py) and from the
persistent rows (what the runner does). Under async scheduling this is host work
that must fit inside the device's step; it grew with the context before.

    python bench/host_step_bench.py [--requests 256] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.benchmarks.provenance import provenance  # noqa: E402
from kvserve.engine.kernels.attention.step_metadata import build_host_step  # noqa: E402
from kvserve.engine.runner.block_table_rows import BlockTableRows  # noqa: E402

BLOCK = 16


def timed_ms(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def one_width(requests: int, blocks: int, repeats: int, rng: random.Random) -> dict:
    tables = [[rng.randrange(100_000) for _ in range(blocks - i % 3)] for i in range(requests)]
    items = [SimpleNamespace(request=SimpleNamespace(request_id=f"r{i}"), block_table=t,
                             num_new_tokens=1, spec_token_ids=[])
             for i, t in enumerate(tables)]
    starts = [(len(t) - 1) * BLOCK + 3 for t in tables]
    rows = BlockTableRows()
    lists_ms = timed_ms(lambda: build_host_step(starts, [1] * requests, tables, BLOCK),
                        repeats)
    rows_ms = timed_ms(lambda: build_host_step(starts, [1] * requests, rows.gather(items),
                                               BLOCK), repeats)
    return {"context_tokens": blocks * BLOCK, "from_lists_ms": round(lists_ms, 3),
            "from_rows_ms": round(rows_ms, 3), "speedup": round(lists_ms / rows_ms, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rng = random.Random(0)
    results = [one_width(args.requests, blocks, args.repeats, rng) for blocks in (4, 64, 256)]
    out = {**provenance(None), "benchmark": f"step metadata for {args.requests} decodes, "
           "host ms per step", "results": results}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
