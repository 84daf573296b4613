"""bench/gpu_session.sh, the one call a lent GPU gets, kept from rotting between the
sessions that have one: its whole dry run on this CPU (every stage ok, importing
as the GPU image would), a broken stage failing it, and the driver's deadline:
a stage cut at the deadline keeps what it measured, the next is not started, and
the summary is written before the deadline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import gpu_session
from bench.gpu_session import GUARD_S, Run, Session, Settings, Stage, pytest_outcome

ROOT = Path(__file__).resolve().parents[2]


def dry_run(out: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "KVSERVE_GPU_DRY_RUN": "1", "PYTHON": sys.executable,
            "OUT": str(out), **env}
    full.pop("PYTEST_XDIST_WORKER", None)  # the tests stage is a pytest of its own
    return subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=1600)


def test_dry_run_ends_every_stage_ok(tmp_path):
    # The GPU's deadline and stage limits are for the GPU: here the stages run on a CPU
    # shared with the rest of the suite (the dry run alone takes ~2.5 minutes; under
    # CI's load its last stage was left unstarted at a 570 s deadline, and the run
    # failed once more at 850 s after the families stage came), so they get 1,500 s,
    # each stage up to 600; an idle run still ends in ~150 s.
    limits = " ".join(f"{stage.name}:600" for stage in gpu_session.stages(
        gpu_session.Settings.from_env({"KVSERVE_GPU_DRY_RUN": "1"})))
    proc = dry_run(tmp_path, DEADLINE_S="1500", LIMITS=limits)
    summary = tmp_path / "summary.txt"
    # The stages' statuses head the summary: shown first, whatever follows.
    assert proc.returncode == 0, (summary.read_text()[:3000] if summary.exists() else "") + \
        proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(gpu_session.FILES)
    results = json.loads((tmp_path / "results.json").read_text())
    names = [s.name for s in gpu_session.stages(Settings.from_env(
        {"KVSERVE_GPU_DRY_RUN": "1"}))]
    assert list(results["stages"]) == names
    assert all(st["status"] == "ok" for st in results["stages"].values())
    assert "kvserve imports ok" in results["environment"]["software"]
    assert results["stages"]["tests"]["counts"]["passed"] > 0
    for name in ("bench_1b", "bench_8b", "forward_1b", "quant_8b"):
        for label, run in results["stages"][name]["runs"].items():
            assert run["result"]["kvserve"]["decode"]["tok_s"] > 0, (name, label)
    for label, run in results["stages"]["profile_1b"]["runs"].items():
        assert run["result"]["kvserve"]["profile"]["wall_ms_per_step"] > 0, label
    assert results["stages"]["step_overhead_1b"]["runs"][""]["result"]["step_ms"] > 0
    assert results["stages"]["lora_1b"]["runs"][""]["result"]["lora_tok_s"]
    summary = (tmp_path / "summary.txt").read_text()
    assert all(f"{name}: ok" in summary for name in names)
    assert "forward_1b --compile wait: llama-tiny" in summary and "next call" not in summary


def test_a_broken_stage_fails_the_dry_run(tmp_path):
    proc = dry_run(tmp_path, ONLY="bench_1b", BENCH_ARGS="--no-such-flag")
    assert proc.returncode == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["stages"]["bench_1b"]["status"] == "exit 2"
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "stages.log").read_text()
    assert 'next call: ONLY="bench_1b"' in (tmp_path / "summary.txt").read_text()


def test_unknown_stages_are_refused(tmp_path):
    proc = dry_run(tmp_path, ONLY="bench_70b")
    assert proc.returncode == 2 and "unknown stages ['bench_70b']" in proc.stderr


# A benchmark as the driver sees one: it saves its JSON after each phase, then hangs.
PHASES = """
import json, sys, time
path = sys.argv[1]
json.dump({"preset": "x", "kvserve": {"decode": {"tok_s": 42.0}}}, open(path + ".w", "w"))
import os; os.replace(path + ".w", path)
time.sleep(120)
"""


def settings(tmp_path: Path, seconds_left: float) -> Settings:
    return Settings(out=tmp_path / "out", dry=True,
                    deadline=time.time() + GUARD_S + seconds_left, python=[sys.executable],
                    only=None, limits={}, tests=[], bench_args=[], preset_1b="a",
                    preset_8b="b", commit="test")


def test_the_deadline_cuts_a_stage_keeps_its_phases_and_starts_no_more(tmp_path):
    s = settings(tmp_path, seconds_left=8)
    result = tmp_path / "bench.json"
    hanging = Stage("bench_1b", 300, [Run("", [sys.executable, "-c", PHASES, str(result)],
                                          result)], min_s=2)
    after = Stage("bench_8b", 300, [Run("", [sys.executable, "-c", "pass"])], min_s=2)
    session = Session(s)
    t0 = time.time()
    assert not session.run_all([hanging, after])
    assert time.time() < s.deadline - GUARD_S + 10  # the stop's own grace included
    results = json.loads((s.out / "results.json").read_text())
    cut = results["stages"]["bench_1b"]
    assert cut["status"].startswith("cut at") and cut["given_s"] <= 8
    assert cut["runs"][""]["result"]["kvserve"]["decode"]["tok_s"] == 42.0
    assert results["stages"]["bench_8b"]["status"].startswith("not started")
    summary = (s.out / "summary.txt").read_text()
    assert "ours tok/s: 42" in summary and 'next call: ONLY="bench_1b bench_8b"' in summary
    assert time.time() - t0 < 30


def test_limits_and_minimums(tmp_path):
    s = settings(tmp_path, seconds_left=100)
    s.limits = {"quick": 3}
    quick = Stage("quick", 300, [Run("a", [sys.executable, "-c", "import time; time.sleep(30)"]),
                                 Run("b", [sys.executable, "-c", "pass"])], min_s=1)
    greedy = Stage("greedy", 300, [Run("", [sys.executable, "-c", "pass"])], min_s=200)
    session = Session(s)
    assert not session.run_all([quick, greedy])
    stages = session.results["stages"]
    assert stages["quick"]["given_s"] == 3  # LIMITS overrides the stage's own
    assert stages["quick"]["runs"]["a"]["status"].startswith("cut at")
    assert stages["quick"]["runs"]["b"]["status"].startswith("not started")
    assert stages["greedy"]["status"].startswith("not started")


def test_pytest_outcome_reads_counts_and_failures(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("tests/a.py::test_x PASSED\nFAILED tests/b.py::test_y - boom\n"
                   "ERROR tests/c.py - ImportError\n"
                   "=== 1 failed, 12 passed, 3 skipped, 1 error in 9.1s ===\n")
    assert pytest_outcome(log) == {
        "counts": {"failed": 1, "passed": 12, "skipped": 3, "error": 1},
        "failed_tests": ["tests/b.py::test_y", "tests/c.py"]}
