#!/usr/bin/env python
"""CPU time of one scheduler step (schedule() + update(), the KV-cache pool included)
at 256 running requests and 1,000 waiting, with no model: a fake runner returns one
token per request that samples.

Workload: 256 requests with prompts of 512..2,048 tokens are admitted and prefilled
first; then 1,000 more (same prompt lengths) arrive and wait: the 256 seats are taken
(max_num_seqs), and the pool, sized for the 256 to decode through the whole run
without a preemption, could hold only a few dozen of them. Outputs are long enough
that nobody finishes. Each measured step is then 256 decodes: allocate_slots per
request (a new block for about one in 16), a copy of each block table, the admission
check, and update() appending 256 tokens.

Timed: process CPU time (steadier than wall time on a shared host) and wall time, per
step, over --rounds x --steps steps after --warmup; median and p99 in microseconds.
A second pass wraps the KVCacheManager methods to show the pool's share of the step
(the wrappers add time of their own, so that pass is reported apart).

    python bench/scheduler_bench.py [--steps 500] [--policy fcfs priority] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.method_timer import MethodTimer  # noqa: E402
from kvserve.benchmarks.provenance import provenance  # noqa: E402
from kvserve.kvcache import KVCacheManager  # noqa: E402
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.request import Request  # noqa: E402
from kvserve.scheduler.sampling_params import SamplingParams  # noqa: E402
from kvserve.scheduler.scheduler import Scheduler  # noqa: E402

VOCAB = 32000
KV_METHODS = ("allocate_slots", "block_table", "take_copies", "free", "lookup_prefix", "fork")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--waiting", type=int, default=1000)
    p.add_argument("--min-prompt", type=int, default=512)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--steps", type=int, default=500, help="measured steps per round")
    p.add_argument("--rounds", type=int, default=3,
                   help="measured rounds, one after another (the spread shows host noise)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--policy", nargs="+", default=["fcfs", "priority"],
                   choices=["fcfs", "priority"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


class Bench:
    def __init__(self, args: argparse.Namespace, policy: str):
        self.args = args
        rng = random.Random(args.seed)
        bs = args.block_size
        lens = [rng.randint(args.min_prompt, args.max_prompt)
                for _ in range(args.running + args.waiting)]
        self.prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]
        self.priorities = [0] * args.running + [rng.randrange(4) for _ in range(args.waiting)]
        # Steps of the whole run: fill (the 256 prompts at `budget` tokens a step),
        # warmup, the measured rounds and the wrapped pass. The pool holds the 256
        # through all of them (no preemption, a little room to spare); outputs
        # are twice as long, so nobody finishes.
        fill = -(-sum(lens[:args.running]) // args.budget) + 2
        run_steps = fill + args.warmup + (args.rounds + 1) * args.steps + 16
        self.decode_steps = 2 * run_steps
        num_blocks = sum(-(-(n + run_steps) // bs) for n in lens[:args.running])
        self.max_model_len = args.max_prompt + self.decode_steps + 1
        self.kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True, model_key="bench")
        self.sched = Scheduler(SchedulerConfig(
            max_num_seqs=args.running, max_num_batched_tokens=args.budget,
            max_model_len=self.max_model_len, policy=policy), self.kv)
        self.step_no = 0

    def add(self, i: int) -> None:
        params = SamplingParams(max_tokens=self.decode_steps, ignore_eos=True)
        self.sched.add_request(Request(f"r{i}", self.prompts[i], params, eos_token_ids=(),
                                       arrival_time=float(i), priority=self.priorities[i]))

    def run_step(self) -> tuple[int, int, int]:
        """One engine step; returns (CPU ns, wall ns, batched tokens) of the scheduler."""
        sched = self.sched
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        out = sched.schedule()
        c1, w1 = time.process_time_ns(), time.perf_counter_ns()
        # the fake runner (not timed): a token for every request that samples
        k = self.step_no
        sampled = {s.request.request_id: (k * 31 + i) % VOCAB + 10
                   for i, s in enumerate(out.scheduled) if s.samples}
        c2, w2 = time.process_time_ns(), time.perf_counter_ns()
        sched.update(out, sampled)
        c3, w3 = time.process_time_ns(), time.perf_counter_ns()
        self.step_no += 1
        return (c1 - c0) + (c3 - c2), (w1 - w0) + (w3 - w2), out.num_batched_tokens

    def setup(self) -> int:
        a = self.args
        for i in range(a.running):
            self.add(i)
        fill_steps = 0
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.sched.running) \
                or len(self.sched.running) < a.running:
            self.run_step()
            fill_steps += 1
        for i in range(a.running, a.running + a.waiting):
            self.add(i)
        for _ in range(a.warmup):
            self.run_step()
        return fill_steps

    def measure(self) -> dict:
        a = self.args
        cpu, wall, tokens = [], [], []
        preempt0 = self.sched.num_preemptions
        for _ in range(a.steps):
            c, w, t = self.run_step()
            cpu.append(c / 1000)
            wall.append(w / 1000)
            tokens.append(t)
            assert len(self.sched.running) == a.running and len(self.sched.waiting) == a.waiting
        assert self.sched.num_preemptions == preempt0, "the pool was meant to fit the 256"
        return {"cpu_us": cpu, "wall_us": wall, "tokens": tokens}

    def kv_share(self, steps: int) -> dict:
        """Another `steps` steps with the pool's methods wrapped: wall time inside
        them over the step's wall time (both include the wrappers' own cost)."""
        total = 0
        with MethodTimer(self.kv, KV_METHODS) as kv_time:
            for _ in range(steps):
                total += self.run_step()[1]
        return {"kv_wall_us_per_step_wrapped": kv_time.total_ns / steps / 1000,
                "step_wall_us_per_step_wrapped": total / steps / 1000,
                "kv_share": kv_time.total_ns / total if total else 0.0}


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "p99": percentile(values, 99),
            "mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def main(argv=None) -> None:
    args = parse_args(argv)
    results = []
    for policy in args.policy:
        bench = Bench(args, policy)
        t = time.perf_counter()
        fill_steps = bench.setup()
        m = bench.measure()
        rounds = [m] + [bench.measure() for _ in range(args.rounds - 1)]
        cpu = [x for r in rounds for x in r["cpu_us"]]
        wall = [x for r in rounds for x in r["wall_us"]]
        share = bench.kv_share(min(args.steps, 200))
        kv = bench.kv
        results.append({
            "policy": policy, "running": args.running, "waiting": args.waiting,
            "num_blocks": kv.num_blocks, "block_size": args.block_size,
            "budget": args.budget, "fill_steps": fill_steps,
            "steps": args.steps * args.rounds, "rounds": args.rounds,
            "batched_tokens_per_step": statistics.median(m["tokens"]),
            "pool_usage_at_end": round(kv.usage, 4),
            "cpu_us": summarize(cpu), "wall_us": summarize(wall),
            "cpu_us_median_per_round": [round(statistics.median(r["cpu_us"]), 1)
                                        for r in rounds],
            **share, "elapsed_s": round(time.perf_counter() - t, 2)})
    print(f"scheduler step = schedule() + update(), KV pool included; microseconds; "
          f"{args.rounds} x {args.steps} steps")
    print(f"{'policy':<9}{'running':>8}{'waiting':>8}{'cpu med':>9}{'cpu p99':>9}"
          f"{'wall med':>10}{'wall p99':>10}{'kv share':>10}  cpu median per round")
    for r in results:
        print(f"{r['policy']:<9}{r['running']:>8}{r['waiting']:>8}"
              f"{r['cpu_us']['median']:>9.0f}{r['cpu_us']['p99']:>9.0f}"
              f"{r['wall_us']['median']:>10.0f}{r['wall_us']['p99']:>10.0f}"
              f"{r['kv_share']:>9.0%}  "
              + " ".join(f"{x:.0f}" for x in r["cpu_us_median_per_round"]))
    doc = {**provenance(), "benchmark": "scheduler step: schedule() + update(), KV pool "
           "included, fake runner", "results": results}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
