"""The stages of one device-tool call on a lent GPU machine, in order of value, under
one deadline (bench/gpu_session.sh installs the carried wheels, then runs this).

A session has 15 minutes of device time, the machine's start included, and one
call at most 600 s: in practice one call. So:
- every stage gets min(its limit, the time left before DEADLINE_S - 20 s), and one
  that would get less than its minimum is not started (it is named for the next
  call instead); time a stage does not use goes to the next;
- results are written as they come: each benchmark saves its JSON after every
  phase, and this driver copies it into $OUT/results.json while it runs (so a run
  cut at its limit keeps what it measured); summary.txt is rewritten after every
  stage, the last time before the deadline;
- four files come back whatever runs (the tool returns at most 8): summary.txt,
  results.json, tests.log (pytest) and stages.log (every other command's output).

Stages (`ONLY` picks some, in this order):
  tests             the CUDA paths' test files: Triton attention and the KV store,
                    CUDA graphs, the fp8 cache, the LoRA kernels, parity with
                    transformers in float32, the fused-MoE kernels (8 processes)
  families          every model family through the engine on the GPU (families.log)
  moe_kernels       the routed experts' Triton GEMMs at a Qwen3-30B-A3B layer: bf16,
                    int8 and int4 experts, 1-512 tokens, GB/s against the copy
  latent_kernels    DeepSeek-V3's latent attention kernels: decode GB/s of the
                    latent cache at batch 1-64, a prompt chunk absorbed and expanded
  profile_1b        the 1B preset's batch-1 step under torch.profiler, synchronous
                    and async: device busy time, the host's share, top kernels
  step_overhead_1b  one step at 256 running requests and the scheduler's share,
                    synchronous and with async scheduling
  quant_8b          the 8B preset: bf16, fp8, int8, int4 weights, then the fp8 KV
                    cache against bf16 at a 4k context
  forward_1b        the 1B preset's batch-1 decode: eager, CUDA graphs, int8 and
                    int4 weights (graphs), then the Inductor-compiled forward pass
  lora_1b           16 requests over 4 rank-16 adapters against the base model
  bench_1b          bench/gpu_decode.py on the 1B preset: batch-1 decode tok/s and
                    MBU, TTFT, the prefill/decode split, transformers beside it
  bench_8b          the same on the 8B preset

KVSERVE_GPU_DRY_RUN=1: the same stages on this CPU with the tiny preset and small
workloads, each command importing as the GPU image would (bench/gpu_image_check.py
with the wheels' list taken as installed), the tests stage collecting every file and
running a quick subset through Triton's interpreter. Exit status 0 only if every
stage ends ok (`make gpu-dry-run`; tests/bench/test_gpu_session.py runs it).

Environment: OUT, DEADLINE_S (570), ONLY (stage names), LIMITS ("stage:seconds ..."),
TESTS (test paths), BENCH_ARGS (flags for every gpu_decode run), PRESET_1B,
PRESET_8B, PYTHON, KVSERVE_COMMIT, KVSERVE_SESSION_START (the shell's start, epoch s).
Standard library only: it must run before anything is known to import."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_summary import result_lines  # noqa: E402  (standard library only)
GUARD_S = 20  # kept back from the deadline: the summary, and the tool's own transfer
POLL_S = 1.0
FILES = ("summary.txt", "results.json", "tests.log", "stages.log", "families.log")

# The CUDA paths' test files (issue 49): kernels first, so a cut stage still ran them.
CUDA_TESTS = ["tests/engine/attention", "tests/engine/test_decode_graphs.py",
              "tests/engine/test_kv_fp8.py", "tests/engine/lora/test_triton_lora.py",
              "tests/engine/test_parity.py", "tests/engine/moe",
              # the second KV tier's copies between the device and pinned host memory
              "tests/engine/test_kv_offload.py"]
# Not here: tensor and pipeline parallelism on CUDA (NCCL all-reduces, NCCL P2P
# between stages) need two GPUs or more, which one lent GPU is not; their tests run
# on CPU over gloo (tests/engine/parallel/).
# Every model family through the engine on the GPU (issue 52): Triton attention with
# windows, soft-caps and sinks, the fused-MoE kernels, CUDA graphs, float32 parity;
# and their GGUF files (kept experts read quantized by the Triton GEMMs).
FAMILY_TESTS = ["tests/engine/test_model_families.py", "tests/engine/test_rotary.py",
                "tests/engine/test_gguf_families.py",
                "tests/engine/test_gguf_families_generate.py"]
DRY_FAMILY_TESTS = "test_context_follows_the_scaling"
# The dry run's quick subset of them (the rest is collected, not run, there).
DRY_TESTS = "test_buckets or test_split_plan or test_capture_needs_cuda or test_store"
DRY_RUN_NOTE = ("llama-tiny for both presets, small workloads, Triton interpreted, "
                "imports as on the GPU image; quant_8b leaves out fp8 weights "
                "(torch._scaled_mm needs CUDA); the wheels' install is not run")


@dataclass
class Run:
    """One command of a stage. json: where it saves its result as it goes."""
    label: str
    argv: list[str]
    json: Path | None = None


@dataclass
class Stage:
    name: str
    limit_s: float
    runs: list[Run]
    min_s: float = 30.0  # given less than this, it is not started
    log: str = "stages.log"


@dataclass
class Settings:
    out: Path
    dry: bool
    deadline: float  # time.time() by which the summary is written
    python: list[str]
    only: list[str] | None
    limits: dict[str, float]
    tests: list[str]
    bench_args: list[str]
    preset_1b: str
    preset_8b: str
    commit: str

    @classmethod
    def from_env(cls, env=os.environ) -> "Settings":
        dry = env.get("KVSERVE_GPU_DRY_RUN") == "1"
        start = float(env.get("KVSERVE_SESSION_START") or time.time())
        python = shlex.split(env.get("PYTHON") or sys.executable)
        if dry:  # as the GPU image would import, with the wheels' list taken as there
            python += ["bench/gpu_image_check.py", "--allow-listed", "bench/gpu_wheels.txt"]
        tiny = "llama-tiny" if dry else None
        return cls(out=Path(env.get("OUT") or "/tmp/kvserve-gpu-session"), dry=dry,
                   deadline=start + float(env.get("DEADLINE_S") or 570), python=python,
                   only=env["ONLY"].split() if env.get("ONLY") else None,
                   limits={k: float(v) for k, v in
                           (item.split(":") for item in env.get("LIMITS", "").split())},
                   tests=env["TESTS"].split() if env.get("TESTS") else CUDA_TESTS,
                   bench_args=shlex.split(env.get("BENCH_ARGS", "")),
                   preset_1b=env.get("PRESET_1B") or tiny or "llama-3.2-1b",
                   preset_8b=env.get("PRESET_8B") or tiny or "llama-3.1-8b",
                   commit=env.get("KVSERVE_COMMIT", "unknown"))


def stages(s: Settings) -> list[Stage]:
    """Every stage, in order of value, with its limit (seconds) and commands."""
    # Where each run saves its JSON as it goes (copied into results.json): this
    # process's own, so two sessions on one machine (a dry run beside the suite's)
    # never read each other's.
    py, tmp = s.python, Path(tempfile.gettempdir()) / f"kvserve-gpu-runs-{os.getpid()}"
    small = (["--prompt-len", "32", "--decode-tokens", "4", "--split-decode-tokens", "4",
              "--repeats", "1", "--copy-mib", "8", "--matmul-size", "128"] if s.dry else [])

    def decode(preset: str, name: str, label: str = "", *flags: str) -> Run:
        path = tmp / f"{name}.json"
        return Run(label, [*py, "bench/gpu_decode.py", "--preset", preset, *flags,
                           *small, *s.bench_args, "--json", str(path)], path)

    def modes(preset: str, stage: str, common: list[str], labels: list[str]) -> list[Run]:
        return [decode(preset, f"{stage}-{i}", label, *common, *shlex.split(label))
                for i, label in enumerate(labels)]

    # On the GPU host (16 cores) the tests run in 8 processes: the first call's
    # tests stage spent its 150 s compiling Triton kernels one after another and ran
    # a third of them. A file stays in one process (its engines are built once).
    xdist = [] if s.dry else ["-n", "8", "--dist", "loadfile"]
    pytest_args = [*py, "-m", "pytest", "-v", "-rfE", "--tb=short", "-p", "no:cacheprovider",
                   "--maxfail=20", "--continue-on-collection-errors", "-m", "not slow",
                   "--durations=15", *xdist]
    pytest = [*pytest_args, *(["-k", DRY_TESTS] if s.dry else []), *s.tests]
    families = [*pytest_args, *(["-k", DRY_FAMILY_TESTS] if s.dry else []), *FAMILY_TESTS]
    forward = ["--transformers", "off", "--prompt-len", "256", "--decode-tokens", "64",
               "--split-decode-tokens", "8", "--repeats", "2"]
    quant = ["--transformers", "off", "--prompt-len", "512", "--decode-tokens", "64",
             "--split-decode-tokens", "64", "--repeats", "2"]
    # fp8 weights multiply through torch._scaled_mm: CUDA only (said, not hidden).
    fp8 = [] if s.dry else ["--quantization fp8"]
    long_ctx = "--prompt-len 4096" if not s.dry else "--prompt-len 64"
    overhead = (["--running", "8", "--steps", "3"] if s.dry
                else ["--running", "256", "--steps", "20"])
    lora = (["--requests", "4", "--output-len", "8", "--rounds", "1"] if s.dry
            else ["--rounds", "2"])
    # Where a batch-1 step's time goes (device_profile.py), synchronous and async: the
    # first call measured 2.68 ms a 1B step, 0.82 ms of bytes at the copy bandwidth.
    profiled = ["--transformers", "off", "--prompt-len", "1024", "--decode-tokens", "128",
                "--split-decode-tokens", "128", "--repeats", "2", "--profile-steps", "20"]
    # Ordered by what no call has measured yet (2026-11-28's, bench/results/
    # gpu_h100_2026-11-28.md, ran tests partly, bench_1b, bench_8b, forward_1b but its
    # --compile wait): correctness first, then the step's profile.
    return [
        Stage("tests", 150, [Run("", pytest)], min_s=40, log="tests.log"),
        Stage("families", 120, [Run("", families)], min_s=40, log="families.log"),
        Stage("moe_kernels", 60, [Run("", [
            *py, "bench/moe_triton_speed.py", *(["--small"] if s.dry else []),
            "--json", str(tmp / "moe_kernels.json")], tmp / "moe_kernels.json")]),
        Stage("latent_kernels", 45, [Run("", [
            *py, "bench/latent_triton_speed.py", *(["--small"] if s.dry else []),
            "--json", str(tmp / "latent_kernels.json")], tmp / "latent_kernels.json")]),
        Stage("profile_1b", 90, modes(s.preset_1b, "profile_1b", profiled, [
            "", "--async-scheduling"])),
        Stage("step_overhead_1b", 110, [Run("", [
            *py, "bench/step_overhead.py", "--model", f"preset:{s.preset_1b}",
            "--load-format", "random", *overhead, "--async-scheduling", "both",
            "--json", str(tmp / "step_overhead.json")], tmp / "step_overhead.json")]),
        Stage("quant_8b", 300, modes(s.preset_8b, "quant_8b", quant, [
            "", *fp8, "--quantization int8", "--quantization int4",
            f"{long_ctx} --kv-cache-dtype auto", f"{long_ctx} --kv-cache-dtype fp8"]),
              min_s=60),
        Stage("forward_1b", 150, modes(s.preset_1b, "forward_1b", forward, [
            "--enforce-eager", "--compile off", "--compile off --quantization int8",
            "--compile off --quantization int4", "--compile wait"])),
        Stage("lora_1b", 150, [Run("", [
            *py, "bench/lora_overhead.py", "--model", f"preset:{s.preset_1b}",
            "--load-format", "random", "--compile", "off", *lora,
            "--json", str(tmp / "lora.json")], tmp / "lora.json")]),
        Stage("bench_1b", 90, [decode(s.preset_1b, "bench_1b")]),
        Stage("bench_8b", 140, [decode(s.preset_8b, "bench_8b")], min_s=60),
    ]


@dataclass
class Session:
    settings: Settings
    results: dict = field(default_factory=dict)

    def __post_init__(self):
        s = self.settings
        s.out.mkdir(parents=True, exist_ok=True)
        self.results = {"commit": s.commit, "dry_run": s.dry, "deadline_s": round(
            s.deadline - time.time()), "environment": {}, "stages": {}}
        if s.dry:
            self.results["environment"]["dry run"] = DRY_RUN_NOTE

    # -- files ---------------------------------------------------------------------
    def save(self) -> None:
        """results.json, replaced whole (a cut never leaves half a file)."""
        path = self.settings.out / "results.json"
        tmp = path.with_name(".results.json.partial")
        tmp.write_text(json.dumps(self.results, indent=1) + "\n")
        os.replace(tmp, path)

    def write_summary(self) -> None:
        lines = [f"commit {self.settings.commit}" + ("  (CPU dry run)" if self.settings.dry
                                                     else "")]
        lines += [f"{k}: {v}" for k, v in self.results["environment"].items()]
        later = []
        for name, st in self.results["stages"].items():
            lines.append(f"{name}: {st['status']}" + (
                f" after {st['seconds']} s (limit {st['given_s']} s)" if "seconds" in st
                else ""))
            for label, run in st.get("runs", {}).items():
                if label:
                    lines.append(f"  {label}: {run['status']}")
            lines += [f"  FAILED {t}" for t in st.get("failed_tests", [])]
            if st["status"] != "ok":
                later.append(name)
        lines.append("")
        lines += table_lines(self.results)
        tail = self.settings.out / "tests.log"
        if tail.exists():
            lines += ["", "tests.log, last lines:",
                      *tail.read_text(errors="replace").splitlines()[-3:]]
        if later:
            lines += ["", f'next call: ONLY="{" ".join(later)}"']
        (self.settings.out / "summary.txt").write_text("\n".join(lines) + "\n")

    # -- running -------------------------------------------------------------------
    def left(self) -> float:
        return self.settings.deadline - GUARD_S - time.time()

    def probe(self) -> None:
        """What the machine is, and whether kvserve imports there, once, before any
        stage (a missing package shows here rather than in every stage's log)."""
        py = self.settings.python
        code = ("import sys, torch, triton, transformers\n"
                "print('python', sys.version.split()[0]); print('torch', torch.__version__,"
                " 'cuda', torch.version.cuda, torch.cuda.is_available())\n"
                "print('triton', triton.__version__); print('transformers',"
                " transformers.__version__)\n"
                "import kvserve.engine.core.engine, kvserve.server.entrypoints.app\n"
                "import bench.gpu_decode\n"
                "print('kvserve imports ok')\n")
        probes = {"gpu": ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                          "clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                  "software": [*py, "-c", code]}
        for key, argv in probes.items():
            try:
                proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                      timeout=min(60, max(5, self.left())))
                text = (proc.stdout + (proc.stderr[-500:] if proc.returncode else "")).strip()
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"unavailable ({exc})"
            self.results["environment"][key] = " | ".join(text.splitlines())
        self.save()
        self.write_summary()

    def run_stage(self, stage: Stage) -> str:
        record = self.results["stages"].setdefault(stage.name, {})
        given = min(self.settings.limits.get(stage.name, stage.limit_s), self.left())
        if given < stage.min_s:
            record["status"] = f"not started: {max(0, round(given))} s left, needs {stage.min_s:.0f}"
            return record["status"]
        record.update(status="running", given_s=round(given))
        end, t0 = time.time() + given, time.time()
        statuses = []
        for run in stage.runs:
            runs = record.setdefault("runs", {})
            if statuses and end - time.time() < 5:  # too little left for another
                runs[run.label] = {"status": "not started: the stage's time ran out"}
                statuses.append("cut")
                continue
            runs[run.label] = {"status": "running"}
            status = self._run(run, end, runs[run.label], self.settings.out / stage.log)
            statuses.append(status)
        record["seconds"] = round(time.time() - t0)
        if stage.log != "stages.log":  # a pytest stage's own log
            record.update(pytest_outcome(self.settings.out / stage.log))
        record["status"] = next((s for s in statuses if s != "ok"), "ok")
        return record["status"]

    def _run(self, run: Run, end: float, record: dict, log_path: Path) -> str:
        """Runs one command until it exits or `end`, copying its JSON into the results
        whenever it changes; returns its status."""
        if run.json is not None:
            run.json.parent.mkdir(parents=True, exist_ok=True)
            run.json.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "a") as log:
            log.write(f"\n=== {run.label or 'run'}: {shlex.join(run.argv)}\n")
            log.flush()
            t0 = time.time()
            proc = subprocess.Popen(run.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
            seen = None
            while True:
                try:
                    code = proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    seen = self._copy_result(run, record, seen)
                    if time.time() >= end:
                        _stop(proc)
                        code = None
                        break
            self._copy_result(run, record, seen)
            record["seconds"] = round(time.time() - t0)
            record["status"] = ("ok" if code == 0 else f"exit {code}" if code is not None
                                else f"cut at {record['seconds']} s")
            log.write(f"=== {run.label or 'run'}: {record['status']}\n")
        self.save()
        return record["status"]

    def _copy_result(self, run: Run, record: dict, seen: float | None) -> float | None:
        """The run's JSON into the results if it changed since `seen` (its mtime)."""
        if run.json is None or not run.json.exists():
            return seen
        mtime = run.json.stat().st_mtime
        if mtime != seen:
            try:
                record["result"] = json.loads(run.json.read_text())
            except ValueError:  # caught mid-write: the next poll reads it whole
                return seen
            self.save()
        return mtime

    def run_all(self, todo: list[Stage]) -> bool:
        """Every stage in turn; True if each ended ok."""
        ok = True
        for stage in todo:
            ok &= self.run_stage(stage) == "ok"
            self.save()
            self.write_summary()
        return ok


def _stop(proc: subprocess.Popen) -> None:
    """The command and every process it started (its own session)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def pytest_outcome(log: Path) -> dict:
    """The tests stage's counts and failed tests, from pytest's own last lines."""
    text = log.read_text(errors="replace") if log.exists() else ""
    counts = {word: int(n) for n, word in re.findall(
        r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)", text[-3000:])}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    return {"counts": counts, "failed_tests": failed[:30]}


def table_lines(results: dict) -> list[str]:
    """gpu_summary's lines for every benchmark result so far."""
    lines = []
    for name, st in results["stages"].items():
        for label, run in st.get("runs", {}).items():
            if "result" in run:
                lines += result_lines(run["result"], f"{name} {label}".strip())
    return lines


def main() -> int:
    settings = Settings.from_env()
    every = stages(settings)
    names = [s.name for s in every]
    unknown = set(settings.only or []) - set(names)
    if unknown:
        print(f"unknown stages {sorted(unknown)}; stages: {' '.join(names)}", file=sys.stderr)
        return 2
    todo = [s for s in every if settings.only is None or s.name in settings.only]
    session = Session(settings)
    session.probe()
    ok = session.run_all(todo)
    print((settings.out / "summary.txt").read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
