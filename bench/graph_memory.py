"""What the compiled CPU forward pass costs in memory and disk, and how long it takes
to start, for one model: `kvserve serve --compile wait` from an empty cache (the graph
packages built), then again on the filled cache (a warm start), for each kvserve tree
given, one server at a time, in one run.

Per start: seconds to /health (the server answers once its graphs serve), the
proportional set size (PSS: shared pages split between the processes that map them)
of the server's whole process tree once it answers and after two short requests, the
bytes of the graph packages on disk, and from the log the build's and each package
load's seconds (a load holds the GIL: a serving process's steps wait it out).

    python bench/graph_memory.py --model /tmp/d1b --tree new=. --tree old=/tmp/kvserve-old \\
        --out bench/results/graph_memory_1b_<date>      # .json and .md

A tree is a kvserve source tree (a `git archive` of a commit, or `.`: this one), run
through bench/peers/kvserve.sh as compare_cpu.py's kvserve-src peers are; extra
`kvserve serve` flags after --serve-flags apply to every tree."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_cpu import stop  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402

LOG_TIMES = {"loads_s": r"loaded the (\w+) graph from \S+ in ([\d.]+) s",
             "builds_s": r"compiled the (\w+) graph ahead of time in ([\d.]+) s",
             "ready_s": r"forward pass (?:ready|compiled) in ([\d.]+) s"}


def tree_pss_mib(pid: int) -> float:
    """The PSS of a process and all its descendants, MiB."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return round(total / 2**20, 1)


def disk_mib(folder: Path) -> float:
    if not folder.exists():
        return 0.0
    return round(sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20, 1)


def from_log(text: str) -> dict:
    out: dict = {}
    for key, pattern in LOG_TIMES.items():
        found = re.findall(pattern, text)
        if key == "ready_s":
            out[key] = float(found[-1]) if found else None
        else:
            out[key] = {kind: float(s) for kind, s in found}
    return out


def one_start(tree: Path, model: str, flags: list[str], cache: Path, port: int, log: Path,
              timeout: float) -> dict:
    env = {**os.environ, "KVSERVE_CACHE": str(cache), "MODEL": model,
           "KVSERVE_SRC": str(tree.resolve())}
    cmd = [str(ROOT / "bench" / "peers" / "kvserve.sh"), str(port), *flags]
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{tree}: the server exited {proc.returncode}; see {log}")
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"{tree}: not up after {timeout} s; see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        health = time.perf_counter() - t0
        pss_up = tree_pss_mib(proc.pid)
        for _ in range(2):
            httpx.post(f"{url}/v1/completions", timeout=600, json={
                "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0})
        pss_served = tree_pss_mib(proc.pid)
    finally:
        stop(proc)
    return {"health_s": round(health, 1), "pss_up_mib": pss_up,
            "pss_served_mib": pss_served, "packages_mib": disk_mib(cache / "graphs"),
            "inductor_cache_mib": disk_mib(cache / "inductor"),
            **from_log(log.read_text(errors="replace"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tree", action="append", required=True, help="LABEL=DIR")
    ap.add_argument("--serve-flags", default="", help="extra kvserve serve flags")
    ap.add_argument("--port", type=int, default=8130)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in args.tree:
        label, _, folder = spec.rpartition("=")
        cache = Path(tempfile.mkdtemp(prefix=f"kvserve-mem-{label}-"))
        try:
            for start in ("cold", "warm"):
                log = out.with_name(f"{out.name}_{label}_{start}.log")
                r = one_start(Path(folder), args.model, args.serve_flags.split(), cache,
                              args.port, log, args.timeout)
                results.append({"tree": label, "dir": folder, "start": start, **r})
                print(json.dumps(results[-1]), flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    flags = simd_flags(set(Path("/proc/cpuinfo").read_text().split()))
    out.with_suffix(".json").write_text(json.dumps({
        **provenance(command=" ".join(sys.argv)), "cpu_flags": flags,
        "model": args.model, "results": results}, indent=1))
    head = ["tree", "start", "health_s", "pss_up_mib", "pss_served_mib", "packages_mib",
            "ready_s", "loads_s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r.get(h)) for h in head) + " |" for r in results]
    out.with_suffix(".md").write_text(
        f"# Graph packages: memory, disk and start-up\n\nModel `{args.model}`, flags "
        f"{' '.join(flags)}; command `{' '.join(sys.argv)}`.\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
