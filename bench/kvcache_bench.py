#!/usr/bin/env python
"""CPU cost of the KV-cache manager on an engine-like workload.

1. Workload: N requests (prompt 1..2000 tokens, output 1..500, 30% of them
   starting with one of 8 shared system prompts) flow through a simulated
   engine: admit (lookup_prefix + allocate_slots for the prompt), then one
   decode token per running request per step (allocate_slots), preempt on
   allocation failure (free, re-admit later through the prefix cache), free
   when done. Reports manager operations per second of CPU time.
2. Step cost: 256 running requests each appending one decode token per step;
   CPU microseconds the manager spends per engine step.

Only time inside KVCacheManager calls is counted (process CPU time); the
simulation's own token bookkeeping is outside the timed regions.

    python bench/kvcache_bench.py [--requests 100000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.benchmarks.provenance import provenance  # noqa: E402
from kvserve.kvcache import KVCacheManager  # noqa: E402

clock = time.process_time_ns  # CPU time: steadier than wall time on a busy host
VOCAB = 32000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--num-blocks", type=int, default=50_000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-running", type=int, default=512)
    p.add_argument("--step-requests", type=int, default=256)
    p.add_argument("--step-count", type=int, default=2000)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


class Workload:
    """Request shapes plus a shared random token pool (sliced, not regenerated)."""

    def __init__(self, num_requests: int, rng: random.Random) -> None:
        self.pool = [rng.randrange(VOCAB) for _ in range(1 << 18)]
        self.systems = [
            [rng.randrange(VOCAB) for _ in range(rng.randint(256, 1024))] for _ in range(8)
        ]
        # (prompt length, output length, system prompt index or -1)
        self.specs = [
            (rng.randint(1, 2000), rng.randint(1, 500), self._system_choice(rng))
            for _ in range(num_requests)
        ]
        self._rng = rng

    @staticmethod
    def _system_choice(rng: random.Random) -> int:
        return rng.randrange(8) if rng.random() < 0.3 else -1

    def prompt(self, index: int) -> list[int]:
        length, _, system = self.specs[index]
        # A unique marker token keeps unrelated prompts from sharing blocks by
        # accident; a system prompt (when drawn) goes before it.
        head = (self.systems[system] if system >= 0 else []) + [VOCAB + index]
        start = self._rng.randrange(len(self.pool) - length)
        return (head + self.pool[start : start + length])[: max(length, len(head) + 1)]

    def next_token(self) -> int:
        return self.pool[self._rng.randrange(len(self.pool))]


class EngineSim:
    """Just enough of a scheduler to drive the manager like an engine would:
    admit in arrival order while blocks last (keeping a 1% watermark), decode
    one token per running request per step, and when the pool runs dry
    preempt the newest running request (recompute: it is freed and later
    re-admitted through its own cached prefix)."""

    def __init__(self, args: argparse.Namespace, workload: Workload) -> None:
        self.mgr = KVCacheManager(
            args.num_blocks, args.block_size, not args.no_prefix_caching, "bench-model"
        )
        self.work = workload
        self.max_running = args.max_running
        self.watermark = max(1, args.num_blocks // 100)
        self.waiting = deque(range(len(workload.specs)))
        self.suspended: dict[int, list] = {}  # preempted: [rid, tokens, left]
        self.running: dict[int, list] = {}  # admission order; [rid, tokens, left]
        # Manager CPU time and calls per phase: admit, decode, preempt, finish.
        self.ns: Counter = Counter()
        self.ops: Counter = Counter()
        self.steps = self.preemptions = self.decode_tokens = 0

    def run(self) -> None:
        while self.waiting or self.running:
            self.admit()
            self.decode_step()
            self.finish()
            self.steps += 1

    def admit(self) -> None:
        mgr = self.mgr
        while self.waiting and len(self.running) < self.max_running:
            index = self.waiting[0]
            state = self.suspended.pop(index, None) or self.new_state(index)
            rid, toks = state[0], state[1]
            t0 = clock()
            hit = mgr.lookup_prefix(rid, toks)
            need = mgr.num_new_blocks_needed(rid, len(toks))
            ok = need + self.watermark <= mgr.num_free_blocks
            ok = ok and mgr.allocate_slots(rid, toks, hit, len(toks) - hit)
            if not ok:
                mgr.free(rid)  # give the prefix hits back
            self.ns["admit"] += clock() - t0
            self.ops["admit"] += 3 + (not ok)
            if not ok:
                self.suspended[index] = state
                return
            self.waiting.popleft()
            self.running[index] = state

    def new_state(self, index: int) -> list:
        return [str(index), self.work.prompt(index), self.work.specs[index][1]]

    def decode_step(self) -> None:
        next_token = self.work.next_token
        for state in self.running.values():
            state[1].append(next_token())
        alloc = self.mgr.allocate_slots
        failed = []
        t0 = clock()
        for index, (rid, toks, _) in self.running.items():
            if not alloc(rid, toks, len(toks) - 1, 1):
                failed.append(index)
        self.ns["decode"] += clock() - t0
        self.ops["decode"] += len(self.running)
        self.decode_tokens += len(self.running)
        for index in failed:
            self.make_room(index)

    def make_room(self, index: int) -> None:
        """Preempt newest-first until request ``index`` gets its block (or is
        itself preempted)."""
        while index in self.running:
            victim = next(reversed(self.running))
            self.preempt(victim)
            if victim == index:
                return
            rid, toks, _ = self.running[index]
            t0 = clock()
            ok = self.mgr.allocate_slots(rid, toks, len(toks) - 1, 1)
            self.ns["preempt"] += clock() - t0
            self.ops["preempt"] += 1
            if ok:
                return

    def preempt(self, index: int) -> None:
        state = self.running.pop(index)
        t0 = clock()
        self.mgr.free(state[0])
        self.ns["preempt"] += clock() - t0
        self.ops["preempt"] += 1
        self.preemptions += 1
        state[1].pop()  # its newest token gets no KV now; it is sampled again
        self.decode_tokens -= 1
        self.suspended[index] = state
        self.waiting.appendleft(index)

    def finish(self) -> None:
        done = []
        for index, state in self.running.items():
            state[2] -= 1
            if state[2] <= 0:
                done.append(index)
        free = self.mgr.free
        t0 = clock()
        for index in done:
            free(self.running.pop(index)[0])
        self.ns["finish"] += clock() - t0
        self.ops["finish"] += len(done)


def bench_workload(args: argparse.Namespace) -> dict:
    sim = EngineSim(args, Workload(args.requests, random.Random(args.seed)))
    wall0 = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - wall0
    stats = sim.mgr.stats
    assert sim.mgr.num_free_blocks == args.num_blocks, "blocks leaked"
    total_ns, total_ops = sum(sim.ns.values()), sum(sim.ops.values())
    return {
        "requests": args.requests,
        "engine_steps": sim.steps,
        "manager_ops": total_ops,
        "manager_cpu_s": total_ns / 1e9,
        "ops_per_s": total_ops / (total_ns / 1e9),
        # Mean manager CPU per call, by phase (admit = lookup/needed/allocate).
        "us_per_op": {k: sim.ns[k] / 1e3 / sim.ops[k] for k in sim.ops if sim.ops[k]},
        "decode_tokens": sim.decode_tokens,
        "preemptions": sim.preemptions,
        "prefix_hit_rate": stats.hit_rate,
        "evictions": stats.evictions,
        "simulation_wall_s": wall,
    }


def bench_step(args: argparse.Namespace) -> dict:
    """Per-step manager CPU time with a fixed batch of decoding requests."""
    rng = random.Random(args.seed + 1)
    # Room for every request's longest possible sequence: this part measures
    # the decode path, not preemption.
    longest = -(-(2001 + args.step_count) // args.block_size)
    num_blocks = max(args.num_blocks, args.step_requests * longest)
    mgr = KVCacheManager(num_blocks, args.block_size, not args.no_prefix_caching)
    batch = []
    for i in range(args.step_requests):
        toks = [VOCAB + i] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 2000))]
        rid = f"s{i}"
        hit = mgr.lookup_prefix(rid, toks)
        assert mgr.allocate_slots(rid, toks, hit, len(toks) - hit)
        batch.append((rid, toks))
    alloc, table = mgr.allocate_slots, mgr.block_table
    alloc_us, table_us = [], []
    for _ in range(args.step_count):
        for _, toks in batch:
            toks.append(rng.randrange(VOCAB))
        t0 = clock()
        for rid, toks in batch:
            if not alloc(rid, toks, len(toks) - 1, 1):
                raise RuntimeError("pool too small for the step benchmark")
        t1 = clock()
        for rid, _ in batch:
            table(rid)
        t2 = clock()
        alloc_us.append((t1 - t0) / 1e3)
        table_us.append((t2 - t1) / 1e3)
    return summarize_steps(args, alloc_us, table_us)


def summarize_steps(args: argparse.Namespace, alloc_us: list, table_us: list) -> dict:
    def pct(values, q):
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "running_requests": args.step_requests,
        "steps": args.step_count,
        "alloc_us_per_step_mean": statistics.fmean(alloc_us),
        "alloc_us_per_step_p50": pct(alloc_us, 0.5),
        "alloc_us_per_step_p99": pct(alloc_us, 0.99),
        "alloc_us_per_request": statistics.fmean(alloc_us) / args.step_requests,
        "block_table_us_per_step_mean": statistics.fmean(table_us),
    }


def print_table(workload: dict, step: dict) -> None:
    rows = [
        ("requests", f"{workload['requests']:,}"),
        ("engine steps", f"{workload['engine_steps']:,}"),
        ("manager ops (lookup/allocate/free)", f"{workload['manager_ops']:,}"),
        ("manager CPU time", f"{workload['manager_cpu_s']:.2f} s"),
        ("ops per second", f"{workload['ops_per_s']:,.0f}"),
        *((f"  us per call: {k}", f"{v:.2f} us") for k, v in workload["us_per_op"].items()),
        ("decode tokens", f"{workload['decode_tokens']:,}"),
        ("preemptions", f"{workload['preemptions']:,}"),
        ("prefix hit rate (tokens)", f"{workload['prefix_hit_rate']:.1%}"),
        ("evictions", f"{workload['evictions']:,}"),
        ("simulation wall time", f"{workload['simulation_wall_s']:.1f} s"),
        (
            f"step: {step['running_requests']} decodes, mean",
            f"{step['alloc_us_per_step_mean']:.0f} us",
        ),
        ("step: p50 / p99", "{:.0f} / {:.0f} us".format(
            step["alloc_us_per_step_p50"], step["alloc_us_per_step_p99"])),
        ("step: per request", f"{step['alloc_us_per_request']:.2f} us"),
        ("step: + block_table() for all", f"{step['block_table_us_per_step_mean']:.0f} us"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>14}")


def main(argv=None) -> None:
    args = parse_args(argv)
    step = bench_step(args)
    workload = bench_workload(args)
    print_table(workload, step)
    if args.json:
        result = {
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            **provenance(),
            "workload": workload,
            "step": step,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
