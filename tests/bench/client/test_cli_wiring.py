"""`kvserve bench|estimate` reach bench/client; `kvserve serve` and it stay apart."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.server.entrypoints import cli

ROOT = Path(__file__).resolve().parents[3]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_serve_parsing_does_not_import_the_bench_client():
    r = run_python("import sys; from kvserve.server.entrypoints.cli import build_parser; "
                   "build_parser().parse_args(['serve']); "
                   "assert 'kvserve.benchmarks.client' not in sys.modules, "
                   "'kvserve.benchmarks.client imported'")
    assert r.returncode == 0, r.stderr


def test_kvbench_loads_without_the_server_or_torch():
    r = run_python("import sys, kvserve.benchmarks.client.cli, "
                   "kvserve.benchmarks.client.serve_cmd, kvserve.benchmarks.client.estimate_cmd, kvserve.benchmarks.client.plot; "
                   "bad = {'torch', 'kvserve.engine', 'kvserve.scheduler', 'kvserve.kvcache', "
                   "'kvserve.server', 'matplotlib'} & set(sys.modules); assert not bad, bad")
    assert r.returncode == 0, r.stderr


def test_flags_pass_through_to_kvbench():
    args = cli.build_parser().parse_args(["bench", "serve", "--base-url=http://x",
                                          "--goodput", "ttft:5", "tpot:3", "-h"])
    assert args.command == "bench"
    assert args.argv == ["serve", "--base-url=http://x", "--goodput", "ttft:5", "tpot:3", "-h"]


def test_kvserve_estimate(tmp_path, capsys):
    from tests.bench.client.test_estimate import LLAMA_8B

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    assert cli.main(["estimate", "--model", str(tmp_path), "--gpu", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 131072 and 190 < out["decode_tok_s"] < 230


def test_estimate_calibrated_and_as_a_table(tmp_path, capsys):
    from tests.bench.client.test_estimate import LLAMA_1B

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    (tmp_path / "r.json").write_text(json.dumps({"decode": {"mbu": 0.5}}))
    cli.main(["estimate", "--model", str(tmp_path / "config.json"), "--gpu", "a10g",
              "--batch", "8", "--calibrate", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "A10G" in out and "0.50 / 1.00" in out and "KV per token (bytes)" in out


def test_bad_inputs_are_usage_errors(tmp_path):
    with pytest.raises(SystemExit, match="no such preset"):
        cli.main(["estimate", "--model", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit, match="--token-ids needs"):
        cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--token-ids",
                  "--endpoint", "/v1/chat/completions"])
    with pytest.raises(SystemExit):  # argparse: a malformed SLO
        cli.main(["bench", "serve", "--base-url", "http://x", "--goodput", "itl:5"])
