"""bench/gpu_decode.py on the CPU with the tiny preset: the smoke test that keeps the
GPU benchmark runnable between the sessions that have a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--preset", "llama-tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "64",
         "--decode-tokens", "8", "--split-decode-tokens", "8", "--repeats", "1",
         "--copy-mib", "8"]


def run_bench(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    # No weights, no tokenizer, no network: point the caches at folders that must
    # still hold nothing of the kind afterwards (kvserve's CPU kernels, built once
    # a machine on AVX2 CPUs, may be all there is: engine/kernels/cpu/build.py).
    env = {**os.environ, "KVSERVE_CACHE": str(tmp_path / "kvserve-cache"),
           "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "bench/gpu_decode.py", *SMALL, *extra,
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cache = tmp_path / "kvserve-cache"
    assert not cache.exists() or {p.name for p in cache.iterdir()} == {"cpu_kernels"}
    assert not (tmp_path / "hf-home").exists()
    return json.loads(out.read_text())


def positive(row: dict, *keys: str) -> None:
    for key in keys:
        assert row[key] > 0, (key, row)


def test_tiny_preset_on_cpu(tmp_path):
    r = run_bench(tmp_path)
    assert {"device", "commit", "command", "python"} <= set(r)  # provenance
    assert (r["preset"], r["dtype"], r["device_type"]) == ("llama-tiny", "float32", "cpu")
    positive(r["copy_bandwidth"], "gbps", "buffer_bytes")
    for side in ("kvserve", "transformers"):
        positive(r[side]["decode"], "tok_s", "step_ms", "bytes_read_per_step", "mbu")
        positive(r[side]["ttft"], "median_s")
        positive(r[side]["split"], "prefill_s", "decode_s", "decode_ms_per_token")
        assert 0 < r[side]["split"]["decode_share"] < 1
    # transformers' continuous batching is left to CUDA runs: on the CPU its manager
    # spends 10-60 s sizing and zero-filling a cache from the host's memory.
    assert r["transformers"]["generate_batch"] == {"skipped": "--generate-batch auto"}
    positive(r["ratios_kvserve_over_transformers"], "decode_tok_s", "ttft",
             "split_prefill", "split_decode")



def test_summary_table_reads_full_and_missing_results(tmp_path, capsys):
    from bench.gpu_summary import main

    partial = tmp_path / "partial.json"  # as left by a run killed after kvserve's part
    partial.write_text('{"preset": "llama-3.1-8b", "kvserve": {"decode": {"tok_s": 80.0}}}')
    main([str(partial), str(tmp_path / "missing.json")])
    out = capsys.readouterr().out
    assert "llama-3.1-8b" in out and "ours tok/s: 80" in out and "hf tok/s: -" in out
    assert "missing.json: no result" in out


def test_a_cut_run_keeps_its_phases(tmp_path, monkeypatch):
    """bench/gpu_session.py copies the JSON in while a run goes on: after kvserve's
    decode phase the file already holds its tok/s and MBU (the 8B stage's number),
    before TTFT, the split and transformers."""
    from bench import gpu_decode
    from kvserve.benchmarks.in_process import decode

    out, seen = tmp_path / "r.json", []
    ttft = decode.ours_ttft

    def spy(*args):
        seen.append(json.loads(out.read_text()))  # as a cut here would leave it
        return ttft(*args)

    monkeypatch.setattr(decode, "ours_ttft", spy)
    gpu_decode.main([*SMALL, "--transformers", "off", "--json", str(out)])
    first = seen[0]
    assert first["kvserve"]["decode"]["tok_s"] > 0 and first["kvserve"]["decode"]["mbu"] > 0
    assert "ttft" not in first["kvserve"] and first["copy_bandwidth"]["gbps"] > 0


def test_async_scheduling_and_a_profiled_phase_on_cpu(tmp_path):
    """--async-scheduling: one more step drains the last token, the first token is
    timed when a step first returns it; --profile-steps adds the profiled steps'
    wall time (no device timeline on the CPU, so no kernel rows)."""
    r = run_bench(tmp_path, "--transformers", "off", "--async-scheduling",
                  "--profile-steps", "3")
    k = r["kvserve"]
    positive(k["decode"], "tok_s", "step_ms")
    positive(k["ttft"], "median_s")
    assert k["profile"]["steps"] == 3 and k["profile"]["wall_ms_per_step"] > 0
    assert "device_busy_ms" not in k["profile"]


def test_kernel_summary_counts_overlapping_kernels_once():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from kvserve.benchmarks.in_process.device_profile import kernel_summary, union_length

    def event(name, start, end, device=DeviceType.CUDA):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, device_type=device, time_range=span)

    assert union_length([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    events = [event("gemv", 0, 600), event("attn", 500, 800), event("gemv", 1000, 1600),
              event("aten::mm", 0, 5000, DeviceType.CPU)]  # host ops are not kernels
    row = kernel_summary(events, steps=2, wall_s=4e-3)
    assert row["device_busy_ms"] == 0.7  # (800 + 600) us over 2 steps
    assert abs(row["host_share"] - (1 - 1.4 / 4)) < 1e-9
    assert row["kernels_per_step"] == 1.5
    assert [k["name"] for k in row["top_kernels"]] == ["gemv", "attn"]
    assert row["top_kernels"][0] == {"name": "gemv", "ms_per_step": 0.6, "calls_per_step": 1.0}
