"""Latency against throughput: TTFT and ITL (median solid, p99 dashed) over output
tokens/s, one colour per label. Reads kvbench results (a single run or a sweep's
"runs") and `vllm bench serve` results alike, since the keys are the same."""
from __future__ import annotations

import json
from pathlib import Path

PANELS = (("ttft", "TTFT (ms)"), ("itl", "ITL (ms)"))
STATS = (("median", "-", "p50"), ("p99", "--", "p99"))


def runs_of(doc: dict) -> list[dict]:
    return doc.get("runs") or [doc]


def series(runs: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(output throughput, metric) for the runs that have the metric."""
    pairs = [(r["output_throughput"], r[key]) for r in runs if r.get(key) is not None]
    return [x for x, _ in pairs], [y for _, y in pairs]


def load(paths: list[str]) -> list[tuple[str, dict]]:
    named = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        named.append((doc.get("label") or Path(path).stem, doc))
    return named


def plot_results(named: list[tuple[str, dict]], out: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("kvbench: plots need matplotlib: pip install 'kvserve[bench]'") from None
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 4.5))
    for ax, (metric, title) in zip(axes, PANELS):
        for i, (label, doc) in enumerate(named):
            for stat, style, name in STATS:
                xs, ys = series(runs_of(doc), f"{stat}_{metric}_ms")
                ax.plot(xs, ys, style, marker="o", color=f"C{i}", label=f"{label} {name}")
        ax.set(xlabel="output throughput (tok/s)", ylabel=title, title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_main(args) -> int:
    plot_results(load(args.results), args.out)
    print(f"wrote {args.out}")
    return 0
