"""kvserve beside llama.cpp's llama-server and `transformers serve` on this CPU machine.

One server at a time, back to back, in one run: each peer is started (scripts in
bench/peers/), warmed up with two short requests, driven through every workload with
`kvserve bench serve` as the client, and stopped before the next one starts.  With
`--repeats 2` the whole round runs twice (second round in reverse peer order) and the
table gives the median and the spread.

    .venv/bin/python bench/compare_cpu.py \
        --peer kvserve \
        --peer "llama.cpp BF16=llama:/tmp/cmp/models/SmolLM2-135M-Instruct.BF16.gguf" \
        --peer transformers --repeats 2

Writes OUT.json (every kvbench result, commands, versions, machine), OUT.md (the
table) and OUT.png (output tok/s per workload and peer); OUT defaults to
bench/results/cpu_compare_<date>.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "bench" / "peers"
BASELINE = "kvserve"

# name -> (description, kvbench flags).  Every request streams /v1/completions with
# temperature 0 and ignore_eos, so each produces exactly --output-len tokens.
WORKLOADS: dict[str, tuple[str, list[str]]] = {
    "a": ("1 client, 4 requests, 128-token prompts, 128 out",
          ["--dataset", "random", "--num-prompts", "4", "--max-concurrency", "1",
           "--input-len", "128", "--output-len", "128"]),
    "b": ("16 clients, 32 requests, 128 in / 128 out",
          ["--dataset", "random", "--num-prompts", "32", "--max-concurrency", "16",
           "--input-len", "128", "--output-len", "128"]),
    "c": ("32 clients, 64 requests, 256 in / 64 out",
          ["--dataset", "random", "--num-prompts", "64", "--max-concurrency", "32",
           "--input-len", "256", "--output-len", "64"]),
    "d": ("prefix: 16 clients, 32 requests, 4 shared 512-token prefixes + 32-token suffixes, 64 out",
          ["--dataset", "prefix", "--num-prompts", "32", "--max-concurrency", "16",
           "--num-prefixes", "4", "--prefix-len", "512", "--input-len", "32",
           "--output-len", "64"]),
    # Issue 53: prompts of thousands of tokens (prefill-bound: TTFT is the figure), and
    # far more clients than a server runs at once (64 for kvserve, 64 slots for
    # llama-server): the queue, admission and the step's batch at its widest.
    "e": ("long prompts: 2 clients, 8 requests, 4096-token prompts, 32 out",
          ["--dataset", "random", "--num-prompts", "8", "--max-concurrency", "2",
           "--input-len", "4096", "--output-len", "32"]),
    "f": ("high concurrency: 128 clients, 256 requests, 128 in / 64 out",
          ["--dataset", "random", "--num-prompts", "256", "--max-concurrency", "128",
           "--input-len", "128", "--output-len", "64"]),
}
WARMUP = ["--dataset", "random", "--num-prompts", "2", "--max-concurrency", "2",
          "--input-len", "32", "--output-len", "8"]

# (column title, kvbench key, format)
COLUMNS = [("out tok/s", "output_throughput", "{:.1f}"),
           ("TTFT p50 ms", "median_ttft_ms", "{:.0f}"),
           ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"),
           ("ITL mean ms", "mean_itl_ms", "{:.1f}"),
           ("ITL p99 ms", "p99_itl_ms", "{:.1f}"),
           ("E2EL p50 ms", "median_e2el_ms", "{:.0f}"),
           ("failed", "failed", "{:d}")]


# ------------------------------------------------------------------ pure helpers


KINDS = ("kvserve", "kvserve-src", "llama", "transformers", "transformers-nocb")


def parse_peer(spec: str) -> tuple[str, str, str, list[str] | None]:
    """`[LABEL=]KIND[:ARG][@W1,W2]` -> (label, kind, arg, workloads or None for all).
    Kinds: kvserve (ARG: extra `kvserve serve` flags, space-separated), kvserve-src
    (ARG: another source tree of kvserve, e.g. an older commit's `git archive`, then any
    extra `kvserve serve` flags, space-separated: two commits side by side), llama (ARG: a GGUF file, then any
    extra llama-server flags, space-separated, e.g. `-kvu`),
    transformers / transformers-nocb (ARG: a model directory, default the kvserve
    cache's; continuous batching on / off)."""
    spec, _, only = spec.partition("@")
    label, _, rest = spec.rpartition("=")
    kind, _, arg = rest.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown peer kind {kind!r} in {spec!r}")
    if kind in ("llama", "kvserve-src") and not arg:
        raise ValueError(f"{kind} needs a path: {kind}:PATH ({spec!r})")
    return (label or kind), kind, arg, (only.split(",") if only else None)


def aggregate(runs: list[dict]) -> dict[tuple[str, str], dict]:
    """Runs (each {"workload", "peer", "result": kvbench result}) -> per (workload, peer)
    the median of every column over the repeats, the min and max output tok/s, and the
    repeat count.  `failed` is summed, not the median: a failure anywhere shows."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["peer"]), []).append(run["result"])
    out = {}
    for key, results in groups.items():
        row = {}
        for _, metric, _ in COLUMNS:
            values = [r[metric] for r in results if r.get(metric) is not None]
            if metric == "failed":
                row[metric] = sum(values)
            else:
                row[metric] = statistics.median(values) if values else None
        tput = [r["output_throughput"] for r in results if r.get("output_throughput") is not None]
        row["output_throughput_min"] = min(tput) if tput else None
        row["output_throughput_max"] = max(tput) if tput else None
        row["repeats"] = len(results)
        out[key] = row
    return out


def add_ratios(table: dict[tuple[str, str], dict], baseline: str = BASELINE) -> None:
    """Each row's `ratio_to_baseline`: its output tok/s over the baseline's on the same
    workload (None when either is missing or the baseline's is 0)."""
    for (workload, _peer), row in table.items():
        base = table.get((workload, baseline), {}).get("output_throughput")
        mine = row.get("output_throughput")
        row["ratio_to_baseline"] = mine / base if base and mine is not None else None


def markdown_table(table: dict[tuple[str, str], dict], workloads: list[str], peers: list[str],
                   baseline: str = BASELINE) -> str:
    """One markdown table: a row per workload and peer, in the given orders."""
    spread = any(row.get("repeats", 1) > 1 for row in table.values())
    head = ["workload", "peer"] + [c[0] for c in COLUMNS] + [f"/ {baseline} tok/s"]
    if spread:
        head.insert(3, "tok/s min-max")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads:
        for p in peers:
            row = table.get((w, p))
            if row is None:
                continue
            cells = [w, p]
            for title, metric, fmt in COLUMNS:
                v = row.get(metric)
                cells.append("-" if v is None else fmt.format(v))
                if spread and metric == "output_throughput":
                    lo, hi = row.get("output_throughput_min"), row.get("output_throughput_max")
                    cells.append("-" if lo is None else f"{lo:.1f}-{hi:.1f}")
            r = row.get("ratio_to_baseline")
            cells.append("-" if r is None else f"{r:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_as_json(table: dict[tuple[str, str], dict]) -> list[dict]:
    return [{"workload": w, "peer": p, **row} for (w, p), row in table.items()]


# ------------------------------------------------------------------ servers


@dataclass
class Peer:
    label: str
    kind: str
    arg: str
    only: list[str] | None
    port: int
    extra: list[str] = field(default_factory=list)

    def env(self) -> dict:
        env = {**os.environ, "TRANSFORMERS_CB": "0" if self.kind == "transformers-nocb" else "1"}
        if self.kind == "kvserve-src":
            env["KVSERVE_SRC"] = self.arg.split()[0]
        return env

    def command(self, args) -> list[str]:
        if self.kind == "kvserve":
            return [str(PEERS_DIR / "kvserve.sh"), str(self.port), *self.arg.split(), *self.extra]
        if self.kind == "kvserve-src":
            return [str(PEERS_DIR / "kvserve.sh"), str(self.port), *self.arg.split()[1:],
                    *self.extra]
        if self.kind == "llama":
            return [str(PEERS_DIR / "llama_server.sh"), str(self.port), *self.arg.split(),
                    *self.extra]
        return [str(PEERS_DIR / "transformers.sh"), str(self.port), self.model_dir(args), *self.extra]

    def model_dir(self, args) -> str:
        return self.arg or args.model_dir

    def bench_model(self, args) -> list[str]:
        """transformers' /v1/models names nothing for a local directory: say the model."""
        return ["--model", self.model_dir(args)] if self.kind.startswith("transformers") else []


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> float:
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's own process group (it was started in a new session), then
    SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def bench(peer: Peer, args, flags: list[str], save: Path | None) -> dict | None:
    cmd = [str(Path(sys.executable).parent / "kvserve"), "bench", "serve",
           "--base-url", f"http://127.0.0.1:{peer.port}", *peer.bench_model(args),
           "--seed", "0", "--label", peer.label, "--disable-tqdm", "--timeout", "600", *flags]
    if save is not None:
        cmd += ["--save-result", str(save)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.workload_timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"kvbench ran past --workload-timeout {args.workload_timeout:.0f} s: "
                           f"{shlex.join(cmd)}") from None
    if save is None:
        return None
    if not save.exists():
        raise RuntimeError(f"kvbench wrote no result (rc {proc.returncode}): {proc.stderr[-2000:]}")
    doc = json.loads(save.read_text())
    doc["command"] = shlex.join(cmd)
    return doc


def versions(args) -> dict:
    def out(cmd, cwd=None):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)
            return (p.stdout + p.stderr).strip()
        except (OSError, subprocess.SubprocessError) as e:
            return f"unavailable: {e}"

    py = sys.executable
    v = {"kvserve_commit": out(["git", "rev-parse", "HEAD"], cwd=ROOT),
         "kvserve_tree_dirty": bool(out(["git", "status", "--porcelain", "--untracked-files=no"],
                                        cwd=ROOT)),
         "kvserve_src": os.environ.get("KVSERVE_SRC") or str(ROOT),
         "kvserve_src_commit": (Path(os.environ["KVSERVE_SRC"], "COMMIT").read_text().strip()
                                if os.environ.get("KVSERVE_SRC")
                                and Path(os.environ["KVSERVE_SRC"], "COMMIT").exists() else None),
         "torch": out([py, "-c", "import torch; print(torch.__version__)"]),
         "transformers": out([py, "-c", "import transformers; print(transformers.__version__)"]),
         "python": platform.python_version()}
    if os.environ.get("LLAMA_SERVER"):
        v["llama_server"] = out([os.environ["LLAMA_SERVER"], "--version"])
    return v


def cpu_busy(seconds: float = 3.0) -> float:
    """Share of all cores busy over `seconds`, from /proc/stat (0..1)."""
    def sample():
        vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait

    t1, i1 = sample()
    time.sleep(seconds)
    t2, i2 = sample()
    return 1 - (i2 - i1) / max(t2 - t1, 1)


def wait_quiet(max_wait: float, threshold: float = 0.15) -> float:
    """Before a server starts: wait (up to max_wait s) until other processes use under
    `threshold` of the CPU; returns the last measured busy share."""
    start = time.monotonic()
    busy = cpu_busy()
    while busy > threshold and time.monotonic() - start < max_wait:
        busy = cpu_busy()
    return busy


def loadavg() -> str:
    """/proc/loadavg's 1/5/15-minute load: the machine is shared, this shows how much."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    except (OSError, StopIteration):
        isa = []
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": isa, "memory": mem,
            "os": platform.platform()}


# ------------------------------------------------------------------ plot


def plot(table: dict[tuple[str, str], dict], workloads: list[str], peers: list[str],
         path: Path, title: str,
         ylabel: str = "output tokens/s (median; bars: min-max over rounds)") -> None:
    try:
        import matplotlib
    except ImportError:  # the `bench` extra: the figures above are all there is
        print(f"no {path}: matplotlib is not installed (pip install -e '.[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / max(len(peers), 1)
    for i, p in enumerate(peers):
        xs, ys, lo, hi = [], [], [], []
        for j, w in enumerate(workloads):
            row = table.get((w, p))
            if row is None or row.get("output_throughput") is None:
                continue
            xs.append(j + (i - (len(peers) - 1) / 2) * width)
            ys.append(row["output_throughput"])
            lo.append(row["output_throughput"] - row["output_throughput_min"])
            hi.append(row["output_throughput_max"] - row["output_throughput"])
        bars = ax.bar(xs, ys, width, label=p, yerr=[lo, hi], capsize=3)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ax.set_xticks(range(len(workloads)))
    import textwrap

    ax.set_xticklabels([textwrap.fill(f"({w}) {WORKLOADS[w][0]}", 30) for w in workloads],
                       fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------ main


def render(info: dict, out: Path) -> str:
    """Table (median over rounds, with the spread), per-round tables, ratios; writes
    OUT.json (with the table added), OUT.md and OUT.png; returns the main table."""
    runs, labels = info["runs"], info["peers"]
    workloads = list(info["workloads"])
    baseline = BASELINE if BASELINE in labels else labels[0]
    table = aggregate(runs)
    add_ratios(table, baseline)
    info = {**info, "baseline": baseline, "table": table_as_json(table)}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(info, indent=2))
    md = markdown_table(table, workloads, labels, baseline)
    m, rounds = info["machine"], info["rounds_done"]
    lines = [f"# CPU comparison, {info['date']}", "",
             f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['isa'])}), {m['memory']}. "
             "Client: `kvserve bench serve` (streaming /v1/completions, temperature 0, "
             f"ignore_eos, seed 0), one server at a time, {rounds} round(s) (round 2 runs the "
             "peers in reverse order). Each server gets two short warm-up requests first.", ""]
    lines += [f"- ({w}) {d['description']}: `{' '.join(d['kvbench_flags'])}`"
              for w, d in info["workloads"].items()] + [""]
    lines += [f"- `{s['peer']}`: `{s['command']}`" for s in info["servers"] if s["repeat"] == 0]
    lines += [""] + [f"- {n}" for n in info["notes"]] + [""]
    lines += [f"Median over {rounds} round(s); last column: output tok/s over {baseline}'s "
              "on the same workload.", "", md, ""]
    if rounds > 1:
        for rep in range(rounds):
            mine = [r for r in runs if r["repeat"] == rep]
            t = aggregate(mine)
            add_ratios(t, baseline)
            busy = {s["peer"]: s.get("cpu_busy_before") for s in info["servers"]
                    if s["repeat"] == rep}
            lines += [f"Round {rep + 1} alone (other processes' CPU share just before each "
                      "server started: " + ", ".join(
                          f"{p} {b:.2f}" for p, b in busy.items() if b is not None) + ")", "",
                      markdown_table(t, workloads, labels, baseline), ""]
    lines += [f"- failed: {e['peer']} round {e['repeat'] + 1}: {e['error']}"
              for e in info["errors"]]
    lines += [f"Versions: {json.dumps(info['versions'])}", "",
              f"Command: `{info['command']}`"]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    title = f"SmolLM2-135M-Instruct on a {m['cores']}-core CPU ({info['date']}): output tokens/s"
    if info.get("plot_round"):  # a round run on a quiet machine, when another was not
        t = aggregate([r for r in runs if r["repeat"] == info["plot_round"] - 1])
        plot(t, workloads, labels, Path(f"{out}.png"), f"{title}, round {info['plot_round']}",
             "output tokens/s")
    elif table:
        plot(table, workloads, labels, Path(f"{out}.png"), title)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", action="append", default=[],
                    help="LABEL=KIND[:ARG] (kinds: kvserve, llama:GGUF, transformers[:DIR]); "
                         "repeatable, run in this order; the baseline is the one labelled kvserve")
    ap.add_argument("--workloads", default="a,b,c,d")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--model-dir", default=str(Path(os.environ.get("KVSERVE_CACHE")
                                                    or Path.home() / ".cache/kvserve")
                                               / "models/SmolLM2-135M-Instruct"))
    ap.add_argument("--out", default=None, help="prefix of OUT.{json,md,png}")
    ap.add_argument("--raw-dir", default=None, help="kvbench results and server logs "
                    "(default: OUT_raw/)")
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--wait-quiet", type=float, default=120,
                    help="before each server, wait up to this many seconds for other "
                         "processes to leave the CPU (under 15%% busy); 0: don't")
    ap.add_argument("--workload-timeout", type=float, default=600,
                    help="seconds one kvbench run may take; past it the peer's round ends")
    ap.add_argument("--note", action="append", default=[], help="free text for the JSON/MD")
    ap.add_argument("--render", metavar="OUT.json",
                    help="only rewrite OUT.md/OUT.png (and the table in OUT.json) from a result")
    ap.add_argument("--plot-round", type=int, default=0,
                    help="with --render: plot this round (1-based) alone instead of the median")
    args = ap.parse_args(argv)
    if args.render:
        info = json.loads(Path(args.render).read_text())
        if args.plot_round:
            info["plot_round"] = args.plot_round
        print(render(info, Path(args.render).with_suffix("")))
        return 0

    peers = [Peer(*parse_peer(s), port=args.port + i) for i, s in enumerate(args.peer or ["kvserve"])]
    labels = [p.label for p in peers]
    workloads = args.workloads.split(",")
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "bench" / "results" / f"cpu_compare_{date}")
    raw = Path(args.raw_dir or f"{out}_raw")
    raw.mkdir(parents=True, exist_ok=True)

    runs, servers, errors = [], [], []
    t0 = time.time()

    def write(rounds_done: int) -> str:
        info = {"date": date, "machine": machine(), "versions": versions(args),
                "command": shlex.join([sys.executable, *sys.argv]), "notes": args.note,
                "workloads": {w: {"description": WORKLOADS[w][0], "kvbench_flags": WORKLOADS[w][1]}
                              for w in workloads},
                "peers": labels, "servers": servers, "errors": errors, "runs": runs,
                "rounds_done": rounds_done, "wall_s": round(time.time() - t0, 1)}
        md = render(info, out)
        print(f"wrote {out}.json, {out}.md, {out}.png (after {rounds_done} round(s))", flush=True)
        return md

    for rep in range(args.repeats):
        order = peers if rep % 2 == 0 else peers[::-1]
        for peer in order:
            busy = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else None
            log = raw / f"server_{peer.label.replace(' ', '_')}_r{rep}.log"
            cmd = peer.command(args)
            print(f"[{time.time() - t0:6.0f}s] rep {rep} start {peer.label} (others' CPU use "
                  f"{busy if busy is None else round(busy, 2)}): {shlex.join(cmd)}", flush=True)
            with open(log, "w") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=ROOT, env=peer.env())
            try:
                ready = wait_ready(peer.port, proc, args.ready_timeout)
                bench(peer, args, WARMUP, None)
                servers.append({"peer": peer.label, "repeat": rep, "command": shlex.join(cmd),
                                "ready_s": round(ready, 1), "log": str(log),
                                "cpu_busy_before": busy})
                for w in [w for w in workloads if peer.only is None or w in peer.only]:
                    save = raw / f"{w}_{peer.label.replace(' ', '_')}_r{rep}.json"
                    doc = bench(peer, args, WORKLOADS[w][1], save)
                    runs.append({"workload": w, "peer": peer.label, "repeat": rep,
                                 "loadavg_after": loadavg(), "result": doc})
                    print(f"[{time.time() - t0:6.0f}s]   ({w}) {peer.label}: "
                          f"{doc['output_throughput']:.1f} tok/s, TTFT p50 "
                          f"{doc['median_ttft_ms']:.0f} ms, failed {doc['failed']}, "
                          f"load {runs[-1]['loadavg_after']}", flush=True)
            except Exception as e:  # a peer that fails is reported, the run goes on
                errors.append({"peer": peer.label, "repeat": rep, "error": str(e), "log": str(log)})
                print(f"  {peer.label} failed: {e}", flush=True)
            finally:
                stop(proc)
        if rep + 1 < args.repeats:
            write(rep + 1)  # a run cut short still leaves its finished rounds

    md = write(args.repeats)
    print(md)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
