"""What the engine page costs the engine: decode throughput of N streaming requests
with nobody watching, with a bare client reading GET /v1/engine/stream, and with the
page itself open in a headless Chromium, on one `kvserve serve` (the default model
unless --model), in one run, the arms interleaved round by round.

On a single machine the browser's own rendering competes with the server for the same
cores; on a real deployment it runs elsewhere. The bare-stream arm separates the
server's share (snapshots, JSON, SSE) from the browser's. Throughput on a shared
2-core machine moves by several percent from run to run, so each run also records
CPU time, which moves much less: the server's (all its processes) per generated
token, and the browser's (all its processes) as a share of the machine.

  .venv/bin/python bench/engine_page_overhead.py --json bench/results/engine_page_overhead.json

Needs Debian's chromium and playwright (the test extra) for the page arm.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from bench.compare_cpu import loadavg, machine, stop, wait_ready  # noqa: E402
from kvserve.benchmarks.provenance import provenance  # noqa: E402
from tests.support.server import free_port  # noqa: E402

ARMS = ("none", "stream", "page")
# The page's first seconds (parsing, compiling its scripts, the first layout, drawing
# the history) are paid once per opening, not while it is watched: left out.
PAGE_SETTLE_SECONDS = 3.0


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


@contextlib.contextmanager
def nobody(url: str):
    yield lambda: 0.0


@contextlib.contextmanager
def bare_stream(url: str):
    """A client that reads the engine stream and throws it away, in its own thread."""
    import httpx

    done = threading.Event()
    seen = {"bytes": 0}

    def read():
        with httpx.stream("GET", f"{url}/v1/engine/stream", timeout=None) as r:
            for chunk in r.iter_raw():
                seen["bytes"] += len(chunk)
                if done.is_set():
                    return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    time.sleep(1.0)
    try:
        yield lambda: 0.0  # a thread of this process: not told apart
    finally:
        done.set()
        thread.join(5)


@contextlib.contextmanager
def open_page(url: str):
    """The engine page, live, in Debian's chromium (headless: the page counts as
    visible, so its stream stays open and it draws every snapshot)."""
    from playwright.sync_api import expect, sync_playwright

    from tests.support.browser import launch

    me = psutil.Process()
    with sync_playwright() as p:
        before = {child.pid for child in me.children(recursive=True)}  # the driver's
        browser = launch(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        expect(page.locator("#engine-status")).to_have_attribute("data-kind", "live")
        time.sleep(PAGE_SETTLE_SECONDS)
        chromium = [c for c in me.children(recursive=True) if c.pid not in before]
        try:
            yield lambda: cpu_seconds(chromium)
        finally:
            browser.close()


WATCHERS = {"none": nobody, "stream": bare_stream, "page": open_page}


def stream_clients(url: str, clients: int, max_tokens: int) -> dict:
    """bench/stream_clients.py in a process of its own: its load stays off this
    process (the browser's driver, the bare stream's reader)."""
    out = subprocess.run([sys.executable, str(ROOT / "bench/stream_clients.py"), url,
                          "--clients", str(clients), "--max-tokens", str(max_tokens),
                          "--prompt", "Write a story about the sea."],
                         capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout)


def one_run(url: str, server_pid: int, arm: str, clients: int, max_tokens: int) -> dict:
    with WATCHERS[arm](url) as watcher_cpu:
        server = tree(server_pid)
        server_cpu, browser_cpu, start = cpu_seconds(server), watcher_cpu(), time.monotonic()
        result = stream_clients(url, clients, max_tokens)
        wall = time.monotonic() - start
        server_cpu, browser_cpu = cpu_seconds(server) - server_cpu, watcher_cpu() - browser_cpu
    assert result["completed"] == clients, result
    tokens = clients * max_tokens
    return {"arm": arm, "seconds": result["seconds"], "tokens_per_s": tokens / result["seconds"],
            "server_cpu_ms_per_token": 1000 * server_cpu / tokens,
            "browser_share_of_machine": browser_cpu / wall / psutil.cpu_count()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="--model for kvserve serve")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--serve-args", default="", help="more flags for kvserve serve")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    arms = args.arms.split(",")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(ROOT / ".venv/bin/kvserve") if (ROOT / ".venv/bin/kvserve").exists()
           else "kvserve", "serve", "--port", str(port), *args.serve_args.split()]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    runs = []
    try:
        wait_ready(port, proc, 600)
        # Warm-up at full size: the first runs compile the forward pass for the
        # batch sizes the run goes through.
        for _ in range(2):
            one_run(url, proc.pid, "none", args.clients, args.max_tokens)
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for arm in order:
                runs.append(one_run(url, proc.pid, arm, args.clients, args.max_tokens))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        stop(proc)
    def median(arm: str, key: str) -> float:
        return statistics.median(x[key] for x in runs if x["arm"] == arm)

    # Each arm against the no-watcher run of the same round, run next to it: the
    # machine's drift over the minutes of a run cancels out of these ratios.
    def paired(arm: str) -> float | None:
        if "none" not in arms:
            return None
        per_round = len(arms)
        ratios = []
        for r in range(0, len(runs), per_round):
            by_arm = {x["arm"]: x["tokens_per_s"] for x in runs[r:r + per_round]}
            ratios.append(by_arm[arm] / by_arm["none"])
        return round(statistics.median(ratios), 4)

    base = median("none", "tokens_per_s") if "none" in arms else None
    summary = {arm: {"tokens_per_s": round(median(arm, "tokens_per_s"), 2),
                     "vs_none": round(median(arm, "tokens_per_s") / base, 4) if base else None,
                     "vs_none_paired": paired(arm),
                     "server_cpu_ms_per_token": round(median(arm, "server_cpu_ms_per_token"), 3),
                     "browser_share_of_machine": round(
                         median(arm, "browser_share_of_machine"), 4)}
               for arm in arms}
    result = {"provenance": provenance(), "machine": machine(), "loadavg": loadavg(),
              "clients": args.clients, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "command": cmd, "runs": runs, "summary": summary}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
