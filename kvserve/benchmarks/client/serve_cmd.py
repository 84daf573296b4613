"""`kvserve bench serve`: one run, or one run per swept rate / concurrency."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import sys

import httpx
from tqdm import tqdm

from kvserve.benchmarks.client.client import Target
from kvserve.benchmarks.client.datasets import DatasetSpec, make_sessions
from kvserve.benchmarks.client.metrics import summarize
from kvserve.benchmarks.client.provenance import first_model, provenance, server_info
from kvserve.benchmarks.client.report import format_result
from kvserve.benchmarks.client.runner import Run, Traffic


def dataset_spec(args) -> DatasetSpec:
    names = {f.name for f in dataclasses.fields(DatasetSpec)} - {"name"}
    return DatasetSpec(name=args.dataset, **{k: getattr(args, k) for k in names})


def check_args(args) -> None:
    if args.token_ids and args.endpoint != "/v1/completions":
        raise SystemExit("kvbench: --token-ids needs --endpoint /v1/completions")
    if args.token_ids and args.dataset == "conversation":
        raise SystemExit("kvbench: a conversation is text; drop --token-ids")
    if args.sweep_rates and args.sweep_concurrency:
        raise SystemExit("kvbench: sweep rates or concurrency, not both at once")


def traffics(args) -> list[Traffic]:
    """One Traffic per run: the swept values, else the flags as given."""
    base = Traffic(args.request_rate, args.burstiness, args.max_concurrency, args.seed)
    if args.sweep_rates:
        return [dataclasses.replace(base, request_rate=r) for r in args.sweep_rates]
    if args.sweep_concurrency:
        return [dataclasses.replace(base, max_concurrency=c) for c in args.sweep_concurrency]
    return [base]


def headers(args) -> dict:
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def run_once(args, target: Target, traffic: Traffic) -> tuple[list, float]:
    sessions = make_sessions(dataset_spec(args))
    total = sum(len(s.turns) for s in sessions)
    limits = httpx.Limits(max_connections=traffic.max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers(args), limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as http:
        with tqdm(total=total, disable=args.disable_tqdm, file=sys.stderr) as bar:
            run = Run(http, target, traffic, bar.update)
            duration = await run.all(sessions)
    return run.records, duration


def run_result(args, target: Target, traffic: Traffic) -> dict:
    records, duration = asyncio.run(run_once(args, target, traffic))
    metrics = summarize(records, duration, args.percentiles, dict(args.goodput))
    rate = traffic.request_rate
    return {"label": args.label, "endpoint": target.endpoint, "model": target.model,
            "dataset": args.dataset, "request_rate": "inf" if math.isinf(rate) else rate,
            "burstiness": traffic.burstiness, "max_concurrency": traffic.max_concurrency,
            "percentiles": args.percentiles, **metrics}


def make_target(args, info: dict) -> Target:
    model = args.model or first_model(info)
    if model is None:
        raise SystemExit(f"kvbench: no --model given and GET {args.base_url}/v1/models "
                         "named none")
    return Target(args.endpoint, model, {"temperature": args.temperature, **args.extra_body},
                  args.continuous_usage_stats)


def config_of(args) -> dict:
    """The flags as JSON can hold them (inf as "inf", as vLLM writes it)."""
    return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v)
            for k, v in vars(args).items() if k != "func"}


def serve_main(args) -> int:
    check_args(args)
    with httpx.Client(base_url=args.base_url, headers=headers(args), timeout=30) as http:
        info = server_info(http)
    target = make_target(args, info)
    args.label = args.label or target.model
    runs = []
    for traffic in traffics(args):
        runs.append(run_result(args, target, traffic))
        print(format_result(runs[-1], args.percentiles), flush=True)
    doc = {"label": args.label, "config": config_of(args), "provenance": provenance(),
           "server": info}
    doc = {**doc, **runs[0]} if len(runs) == 1 else {**doc, "runs": runs}
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        from kvserve.benchmarks.client.plot import plot_results  # matplotlib only when asked for

        plot_results([(args.label, doc)], args.plot)
    return 0 if all(r["completed"] for r in runs) else 1
