"""bench/bandwidth.py on a tiny working set (the figures are then the cache's, which
is fine here: the test checks that every pass is timed and the run recorded), and
its decode arithmetic on hand-computed numbers."""
from __future__ import annotations

import json

import pytest

from bench.bandwidth import decode_bytes, decode_efficiency, kv_cache_bytes, main


def test_every_pass_is_timed_and_the_machine_recorded(tmp_path, capsys):
    out = tmp_path / "bandwidth.json"
    assert main(["--gib", "0.05", "--repeats", "2", "--threads", "1", "--json", str(out),
                 "--decode-ms", "10", "--model-bytes", "1000000"]) == 0
    result = json.loads(out.read_text())
    assert {"device", "commit", "command", "python"} <= set(result)  # provenance
    assert result["command"].startswith("python") and result["date"]
    assert result["threads"] == 1 and isinstance(result["cpu_flags"], list)
    bw = result["bandwidth"]
    for name in ("read", "copy", "triad"):
        assert bw[name]["best_gbs"] >= bw[name]["median_gbs"] > 0
        assert len(bw[name]["seconds"]) == 2
    # Triad moves three arrays (STREAM), four with the write-allocate read.
    assert bw["triad"]["bytes"] == 3 * bw["array_bytes"]
    assert bw["triad"]["best_gbs_with_write_allocate"] == pytest.approx(
        bw["triad"]["best_gbs"] * 4 / 3)
    assert result["decode"]["achieved_gbs"] == pytest.approx(0.1)
    assert "| triad | 3 x bytes (STREAM) |" in capsys.readouterr().out


def test_decode_bytes_are_the_weights_and_the_kv_cache_at_its_context():
    # 30 layers, 3 KV heads of 64, bf16, 1000 tokens: 30 * 2 * 3 * 64 * 2 * 1000.
    assert kv_cache_bytes(30, 3, 64, 1000) == 23_040_000
    assert decode_bytes(269_060_096, 30, 3, 64, 1000) == 269_060_096 + 23_040_000
    assert decode_bytes(100, 2, 1, 8, 10, dtype_bytes=4) == 100 + 2 * 2 * 8 * 4 * 10


def test_decode_efficiency_is_achieved_bytes_per_second_over_the_read_bandwidth():
    e = decode_efficiency(bytes_per_token=2e9, seconds_per_token=0.25, read_gbs=16.0)
    assert e["achieved_gbs"] == pytest.approx(8.0)
    assert e["fraction_of_read"] == pytest.approx(0.5)
    assert e["tokens_per_s_at_read_bandwidth"] == pytest.approx(8.0)
