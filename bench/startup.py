"""Start-up as a user meets it (issue 53): `kvserve serve` on the default model, its
defaults (the forward pass compiled in the background while steps run eagerly),
timed from the process's start, one server at a time.

Phases, in one run (their order is the order given):
  eager  `--compile off`: the idle eager server's latency for a 16-token answer (the
         median of five), the yardstick of the probes below;
  cold   a fresh KVSERVE_CACHE (nothing converted, no Inductor cache; the default
         model's wheel copied from the real cache's downloads/, so nothing is
         fetched): /health, the first 16-token answer (sent once /health is 200),
         /ready (the compiled graphs serving);
  warm   the same cache again, now filled: /health, /ready.
In cold and warm a 16-token request is sent every --probe-every seconds from /health
until /ready, each timed: what a user (or a load balancer that trusts /health) meets
while the graphs compile, against the idle eager latency. Then the compiled
server's own latency (the median of five).

Targets (issue 53): warm start to compiled graphs serving <= 20 s; cold start to
first answer <= 45 s; while compiling, a 16-token request <= 1.5x the idle eager
server's.

    python bench/startup.py --out bench/results/startup_cpu_<date>      # .json, .md
    python bench/startup.py --phases warm --cache /tmp/kvc --out /tmp/s  # a filled cache"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare_cpu import loadavg, stop, wait_quiet  # noqa: E402
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402

PROMPT = "The three most useful things to pack for a week of hiking are"
TOKENS = 16
TARGETS = {"warm_to_compiled_s": 20.0, "cold_first_answer_s": 45.0,
           "compiling_over_idle_eager": 1.5}


class Server:
    """One `kvserve serve` process, timed from its start."""

    def __init__(self, port: int, flags: list[str], env: dict, log: Path):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        cmd = [str(Path(sys.executable).parent / "kvserve"), "serve", "--port", str(port),
               *flags]
        self.command = " ".join(cmd)
        self.log = log
        with open(log, "wb") as out:
            self.start = time.monotonic()
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=600)
        self.model = ""

    def since(self) -> float:
        return round(time.monotonic() - self.start, 2)

    def ok(self, path: str) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the server exited ({self.proc.returncode}): see {self.log}")
        try:
            return httpx.get(self.url + path, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def wait(self, path: str, timeout: float) -> float:
        """Seconds from the start until `path` answered 200."""
        while not self.ok(path):
            if self.since() > timeout:
                raise RuntimeError(f"{path} not 200 after {timeout:.0f} s: see {self.log}")
            time.sleep(0.25)
        return self.since()

    def answer(self) -> float:
        """Seconds for one 16-token completion."""
        if not self.model:
            self.model = self.http.get("/v1/models").json()["data"][0]["id"]
        t0 = time.monotonic()
        r = self.http.post("/v1/completions", json={
            "model": self.model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == TOKENS, r.text
        return round(time.monotonic() - t0, 3)

    def close(self) -> None:
        self.http.close()
        stop(self.proc)


def _median_answer(server: Server, n: int = 5) -> float:
    return round(statistics.median(server.answer() for _ in range(n)), 3)


def eager_phase(args, env, raw: Path) -> dict:
    server = Server(args.port, ["--compile", "off", *args.flags], env, raw / "eager.log")
    try:
        health = server.wait("/health", args.timeout)
        server.answer()  # first-request costs (tokenizer, allocations) are not the yardstick
        return {"health_s": health, "idle_eager_answer_s": _median_answer(server),
                "command": server.command}
    finally:
        server.close()


def start_phase(name: str, args, env, raw: Path) -> dict:
    """cold or warm: from the start to /ready, probing on the way."""
    server = Server(args.port, args.flags, env, raw / f"{name}.log")
    try:
        result = {"command": server.command, "health_s": server.wait("/health", args.timeout)}
        probes = []  # (seconds since start when sent, seconds it took)
        while not server.ok("/ready"):
            sent = server.since()
            took = server.answer()
            probes.append((sent, took))
            if len(probes) == 1:
                result["first_answer_s"] = round(sent + took, 2)
            if server.since() > args.timeout:
                raise RuntimeError(f"/ready not 200 after {args.timeout:.0f} s")
            pause = sent + args.probe_every - server.since()
            deadline = time.monotonic() + max(pause, 0)
            while time.monotonic() < deadline and not server.ok("/ready"):
                time.sleep(0.25)
        result["ready_s"] = server.since()
        result["probes_while_compiling"] = probes
        result["compiled_answer_s"] = _median_answer(server)
        return result
    finally:
        server.close()


def fresh_cache(real: Path) -> Path:
    """An empty KVSERVE_CACHE but for the default model's downloaded wheel."""
    cache = Path(tempfile.mkdtemp(prefix="kvserve-startup-"))
    if (real / "downloads").is_dir():
        shutil.copytree(real / "downloads", cache / "downloads")
    return cache


def summarise(result: dict) -> dict:
    idle = result.get("eager", {}).get("idle_eager_answer_s")
    out = {}
    if "warm" in result:
        out["warm_to_compiled_s"] = result["warm"]["ready_s"]
    if "cold" in result:
        out["cold_first_answer_s"] = result["cold"].get("first_answer_s")
        out["cold_to_compiled_s"] = result["cold"]["ready_s"]
    worst = [took for phase in ("cold", "warm") if phase in result
             for _, took in result[phase]["probes_while_compiling"]]
    if idle and worst:
        out["compiling_over_idle_eager"] = round(max(worst) / idle, 2)
        out["compiling_median_over_idle_eager"] = round(statistics.median(worst) / idle, 2)
    out["met"] = {k: (out[k] is not None and out[k] <= target)
                  for k, target in TARGETS.items() if k in out}
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [f"# Start-up, {result['date']}", "",
             f"{result['machine']['cpu']}, {result['machine']['cores']} cores, flags "
             f"{' '.join(result['machine']['simd_flags'])}; commit {result['commit']}; "
             f"load before: {result['loadavg']}", "",
             f"`{result['command']}`", "",
             "| measure | seconds | target |", "|---|---|---|"]
    for key, value in s.items():
        if key != "met":
            target = TARGETS.get(key)
            lines.append(f"| {key} | {value} | {'' if target is None else target} "
                         f"{'' if key not in s['met'] else ('met' if s['met'][key] else 'missed')} |")
    for phase in ("eager", "cold", "warm"):
        if phase in result:
            p = result[phase]
            lines += ["", f"## {phase}", "", f"`{p['command']}`", ""]
            lines += [f"- {k}: {v}" for k, v in p.items() if k not in ("command",
                                                                         "probes_while_compiling")]
            if p.get("probes_while_compiling"):
                lines.append("- probes (sent at s: took s): " + ", ".join(
                    f"{sent}: {took}" for sent, took in p["probes_while_compiling"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default="eager,cold,warm")
    ap.add_argument("--cache", type=Path, default=None,
                    help="the KVSERVE_CACHE of cold and warm (default: a fresh one); "
                    "cold needs it empty")
    ap.add_argument("--real-cache", type=Path,
                    default=Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache/kvserve")),
                    help="where the converted default model (for eager) and the "
                    "downloaded wheel are")
    ap.add_argument("--port", type=int, default=8107)
    ap.add_argument("--probe-every", type=float, default=3.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--flag", dest="flags", action="append", default=[],
                    help="a flag for every server (repeat)")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    from kvserve.engine.platform.device import cpu_flags

    args.out.parent.mkdir(parents=True, exist_ok=True)
    raw = Path(tempfile.mkdtemp(prefix="kvserve-startup-logs-"))
    cache = args.cache or fresh_cache(args.real_cache)
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    result = {**provenance(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": {"cpu": cpu, "cores": os.cpu_count(),
                          "simd_flags": simd_flags(cpu_flags())},
              "loadavg": loadavg(), "cpu_busy_before": round(wait_quiet(60), 2),
              "cache": str(cache), "logs": str(raw)}
    for phase in args.phases.split(","):
        env = {**os.environ, "KVSERVE_CACHE": str(args.real_cache if phase == "eager"
                                                  else cache)}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # kvserve puts it under KVSERVE_CACHE
        print(f"{phase} ...", flush=True)
        result[phase] = (eager_phase(args, env, raw) if phase == "eager"
                         else start_phase(phase, args, env, raw))
        print(phase, {k: v for k, v in result[phase].items() if k != "command"}, flush=True)
        result["summary"] = summarise(result)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
