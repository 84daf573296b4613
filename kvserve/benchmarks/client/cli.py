"""`kvserve bench serve|plot` and `kvserve estimate`. server/entrypoints/cli.py hands these
commands' arguments here unparsed, so `kvserve serve` never imports kvbench."""
from __future__ import annotations

import argparse

from kvserve.benchmarks.client.estimate_cmd import add_estimate_args
from kvserve.benchmarks.client.serve_args import add_serve_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve")
    top = parser.add_subparsers(dest="command", required=True)
    bench = top.add_parser("bench", help="load-test an OpenAI-compatible server",
                           epilog="`kvserve bench offline` and `kvserve bench decode` "
                           "run the engine in process instead (bench/in_process; "
                           "see their --help).")
    tools = bench.add_subparsers(dest="tool", required=True)
    add_serve_args(tools.add_parser("serve", help="streaming load generator"))
    plot = tools.add_parser("plot", help="TTFT/ITL vs throughput from result JSONs")
    plot.add_argument("results", nargs="+", help="result JSON files (kvbench or vLLM)")
    plot.add_argument("--out", required=True, help="PNG file")
    add_estimate_args(top.add_parser("estimate", help="roofline: memory, speed, cost"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "estimate":
        from kvserve.benchmarks.client.estimate_cmd import estimate_main

        return estimate_main(args)
    if args.tool == "plot":
        from kvserve.benchmarks.client.plot import plot_main

        return plot_main(args)
    from kvserve.benchmarks.client.serve_cmd import serve_main  # httpx and tqdm only for a run

    return serve_main(args)
