"""Flags of `kvserve bench serve`."""
from __future__ import annotations

import argparse
import json
import math

from kvserve.benchmarks.client.datasets import GENERATORS

SLO_KEYS = ("ttft", "tpot", "e2el")


def number_list(type_):
    def parse(text: str) -> list:
        try:
            return [type_(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list: {text!r}") from None
    return parse


def slo(text: str) -> tuple[str, float]:
    """'ttft:500' -> ('ttft', 500.0), milliseconds."""
    key, _, value = text.partition(":")
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if key not in SLO_KEYS or ms < 0:
        raise argparse.ArgumentTypeError(f"want KEY:MS with KEY in {SLO_KEYS}, got {text!r}")
    return key, ms


def add_serve_args(p: argparse.ArgumentParser) -> None:
    _target_args(p.add_argument_group("server"))
    _dataset_args(p.add_argument_group("dataset (deterministic for --seed)"))
    _traffic_args(p.add_argument_group("traffic"))
    _output_args(p.add_argument_group("results"))


def _target_args(g) -> None:
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    g.add_argument("--api-key", default=None, help="default: env OPENAI_API_KEY")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON merged into every request, e.g. \'{"top_k": 20}\'')
    g.add_argument("--continuous-usage-stats", action="store_true",
                   help="ask for usage in every chunk (vLLM), so ITL knows how many "
                   "tokens each chunk holds (logprobs in --extra-body also tell it)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def _dataset_args(g) -> None:
    g.add_argument("--dataset", default="random", choices=sorted(GENERATORS))
    g.add_argument("--num-prompts", type=int, default=100,
                   help="requests; sessions for --dataset conversation")
    g.add_argument("--input-len", type=int, default=1024,
                   help="words (or token ids) per prompt; per user message in a conversation")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    g.add_argument("--prefix-len", type=int, default=512, help="shared prefix words (prefix)")
    g.add_argument("--num-prefixes", type=int, default=4, help="prefix groups (prefix)")
    g.add_argument("--turns", type=int, default=3, help="turns per session (conversation)")
    g.add_argument("--token-ids", action="store_true",
                   help="prompts as token ids, not words (/v1/completions only)")
    g.add_argument("--vocab-size", type=int, default=1000, help="token ids in [0, this)")
    g.add_argument("--seed", type=int, default=0)


def _traffic_args(g) -> None:
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests (sessions) per second; inf: all at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrivals: 1 Poisson, <1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--sweep-rates", type=number_list(float), default=None,
                   help="run once per rate, e.g. 1,2,4")
    g.add_argument("--sweep-concurrency", type=number_list(int), default=None,
                   help="run once per --max-concurrency, e.g. 1,4,16")


def _output_args(g) -> None:
    g.add_argument("--percentiles", type=number_list(float), default=[99.0],
                   help="reported besides mean and median, e.g. 50,90,99")
    g.add_argument("--goodput", type=slo, nargs="+", default=[],
                   help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:10000")
    g.add_argument("--label", default=None, help="name of this line in plots")
    g.add_argument("--save-result", default=None, help="JSON file")
    g.add_argument("--plot", default=None, help="PNG of latency vs throughput (sweeps)")
    g.add_argument("--disable-tqdm", action="store_true")
