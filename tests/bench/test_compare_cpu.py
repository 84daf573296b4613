"""Pure helpers of bench/compare_cpu.py: peer specs, aggregation over repeats, ratios
and the markdown table.  No servers, no model."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compare_cpu", ROOT / "bench" / "compare_cpu.py")
cc = importlib.util.module_from_spec(_spec)
sys.modules["compare_cpu"] = cc  # dataclasses look their module up there
_spec.loader.exec_module(cc)


def result(tput, ttft=100.0, failed=0):
    return {"output_throughput": tput, "median_ttft_ms": ttft, "p99_ttft_ms": ttft * 2,
            "mean_itl_ms": 10.0, "p99_itl_ms": 20.0, "median_e2el_ms": 1000.0,
            "failed": failed}


def test_parse_peer():
    assert cc.parse_peer("kvserve") == ("kvserve", "kvserve", "", None)
    assert cc.parse_peer("llama.cpp BF16=llama:/m/x.gguf") == ("llama.cpp BF16", "llama", "/m/x.gguf", None)
    assert cc.parse_peer("transformers:/models/d") == ("transformers", "transformers", "/models/d", None)
    assert cc.parse_peer("hf b1=transformers-nocb@a") == ("hf b1", "transformers-nocb", "", ["a"])
    with pytest.raises(ValueError):
        cc.parse_peer("vllm")
    with pytest.raises(ValueError):
        cc.parse_peer("llama")
    assert cc.parse_peer("before=kvserve-src:/tmp/old@a,b") == ("before", "kvserve-src",
                                                              "/tmp/old", ["a", "b"])
    with pytest.raises(ValueError):
        cc.parse_peer("kvserve-src")


def test_a_llama_peer_takes_extra_flags_after_its_gguf():
    """`llama:FILE -kvu`: the long-prompt workload's llama-server shares one KV pool."""
    peer = cc.Peer(*cc.parse_peer("llama kvu=llama:/m/x.gguf -kvu@e"), port=8191)
    assert peer.only == ["e"]
    assert peer.command(None)[1:] == ["8191", "/m/x.gguf", "-kvu"]
    assert cc.Peer(*cc.parse_peer("llama:/m/x.gguf"), port=8191).command(None)[1:] == [
        "8191", "/m/x.gguf"]


def test_a_source_tree_peer_serves_that_tree():
    """kvserve-src:DIR runs bench/peers/kvserve.sh with KVSERVE_SRC=DIR: two commits
    side by side in one run (the launcher finds the CLI in old layouts too)."""
    peer = cc.Peer("before", "kvserve-src", "/tmp/old", None, 8190)
    assert peer.env()["KVSERVE_SRC"] == "/tmp/old"
    assert peer.command(None) == [str(cc.PEERS_DIR / "kvserve.sh"), "8190"]
    # flags after the tree: that tree served with them (--quantization int8 side by side)
    flagged = cc.Peer("before int8", "kvserve-src", "/tmp/old --quantization int8", None, 8191)
    assert flagged.env()["KVSERVE_SRC"] == "/tmp/old"
    assert flagged.command(None) == [str(cc.PEERS_DIR / "kvserve.sh"), "8191",
                                     "--quantization", "int8"]
    script = (cc.PEERS_DIR / "kvserve.sh").read_text()
    assert "entry=server.cli" in script and "entry=kvserve.server.entrypoints.cli" in script


def test_aggregate_median_spread_and_failed_sum():
    runs = [{"workload": "a", "peer": "kvserve", "result": result(100, failed=1)},
            {"workload": "a", "peer": "kvserve", "result": result(120, ttft=300)},
            {"workload": "a", "peer": "llama", "result": result(150)}]
    t = cc.aggregate(runs)
    kv = t[("a", "kvserve")]
    assert kv["output_throughput"] == 110
    assert (kv["output_throughput_min"], kv["output_throughput_max"]) == (100, 120)
    assert kv["median_ttft_ms"] == 200
    assert kv["failed"] == 1 and kv["repeats"] == 2
    assert t[("a", "llama")]["repeats"] == 1


def test_ratios_against_baseline_per_workload():
    runs = [{"workload": w, "peer": p, "result": result(v)}
            for w, p, v in (("a", "kvserve", 100), ("a", "llama", 150),
                            ("b", "kvserve", 0), ("b", "llama", 50), ("c", "llama", 10))]
    t = cc.aggregate(runs)
    cc.add_ratios(t)
    assert t[("a", "kvserve")]["ratio_to_baseline"] == 1.0
    assert t[("a", "llama")]["ratio_to_baseline"] == 1.5
    assert t[("b", "llama")]["ratio_to_baseline"] is None   # baseline produced nothing
    assert t[("c", "llama")]["ratio_to_baseline"] is None   # no baseline run


def test_markdown_table_order_and_spread_column():
    runs = [{"workload": "b", "peer": "llama", "result": result(150)},
            {"workload": "b", "peer": "kvserve", "result": result(100)},
            {"workload": "a", "peer": "kvserve", "result": result(50)}]
    t = cc.aggregate(runs)
    cc.add_ratios(t)
    md = cc.markdown_table(t, ["a", "b"], ["kvserve", "llama"]).splitlines()
    assert md[0].startswith("| workload | peer | out tok/s | TTFT p50 ms")
    assert "min-max" not in md[0]
    assert [line.split(" | ")[:2] for line in md[2:]] == [["| a", "kvserve"], ["| b", "kvserve"],
                                                           ["| b", "llama"]]
    assert md[-1].endswith("| 1.50 |")
    runs.append({"workload": "a", "peer": "kvserve", "result": result(70)})
    t = cc.aggregate(runs)
    cc.add_ratios(t)
    md = cc.markdown_table(t, ["a", "b"], ["kvserve", "llama"]).splitlines()
    assert "tok/s min-max" in md[0] and "| 60.0 | 50.0-70.0 |" in md[2]


def test_every_workload_is_a_kvbench_flag_list():
    for desc, flags in cc.WORKLOADS.values():
        assert desc and "--output-len" in flags and "--max-concurrency" in flags


def test_bf16_checkpoint_rounds_every_float_weight(tmp_path):
    """bench/peers/bf16_checkpoint.py: the same tensors in bf16, the rest copied."""
    import json

    import torch
    from safetensors.torch import load_file

    from bench.peers.bf16_checkpoint import convert
    from tests.support.tiny_models import make_tiny_model

    src = make_tiny_model(tmp_path / "fp32")
    convert(src, tmp_path / "bf16")
    before = load_file(src / "model.safetensors")
    after = load_file(tmp_path / "bf16" / "model.safetensors")
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert after[name].dtype == torch.bfloat16
        assert torch.equal(after[name], t.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "bf16" / "tokenizer.json").exists()
