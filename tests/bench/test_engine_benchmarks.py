"""`kvserve bench offline` and `kvserve bench decode` (bench/in_process): both end to
end in this process on the CPU with tiny sizes, the MFU/MBU arithmetic on numbers
worked by hand, and the routing of `kvserve bench TOOL`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.benchmarks.in_process.utilisation import (attention_flops, bytes_per_decode_step,
                                                       matmul_params, mbu, mfu, peak_tflops,
                                                       prefill_flops, table_peak_tflops)
from kvserve.engine.config.model_config import ModelConfig
from kvserve.server.entrypoints import cli

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "preset:llama-tiny", "--load-format", "random", "--device", "cpu"]


def positive(row: dict, *keys: str) -> None:
    for key in keys:
        assert row[key] > 0, (key, row)


def test_bench_offline_end_to_end(tmp_path, capsys):
    out = tmp_path / "offline.json"
    # Eager: what is tested is the benchmark's arithmetic and report, not compiling
    # (which would be most of this test's time on two cores).
    assert cli.main(["bench", "offline", *TINY, "--num-prompts", "4", "--input-len", "16",
                     "--output-len", "8", "--num-kv-blocks", "32", "--compile", "off",
                     "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert {"device", "commit", "command", "python"} <= set(r)
    assert r["command"].startswith("kvserve bench offline --model preset:llama-tiny")
    assert (r["model"], r["dtype"], r["device_type"]) == ("preset:llama-tiny", "float32",
                                                          "cpu")
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (4, 64, 32)
    positive(r, "elapsed_s", "requests_per_s", "output_tokens_per_s",
             "total_tokens_per_s", "engine_steps")
    assert r["total_tokens_per_s"] == pytest.approx(96 / r["elapsed_s"])
    assert r["config"]["num_kv_blocks"] == 32 and r["config"]["seed"] == 0
    table = capsys.readouterr().out
    assert "requests/s" in table and "output tokens/s" in table


def test_bench_decode_end_to_end(tmp_path, capsys):
    out = tmp_path / "decode.json"
    # Stated: auto is bf16 on CPUs with native bf16 (the suite's engines stay float32).
    # Eager, as offline above: the report is under test, not compiling.
    assert cli.main(["bench", "decode", *TINY, "--dtype", "float32",
                     "--prompt-len", "32", "--decode-tokens", "4",
                     "--split-decode-tokens", "4", "--repeats", "1", "--copy-mib", "4",
                     "--matmul-size", "128", "--compile", "off", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert {"device", "commit", "command", "python"} <= set(r)
    assert r["command"].startswith("kvserve bench decode")
    assert (r["preset"], r["dtype"], r["device_type"]) == ("llama-tiny", "float32", "cpu")
    positive(r["copy_bandwidth"], "gbps")
    positive(r["peak_flops"], "tflops")
    assert r["peak_flops"]["source"] == "measured: 128x128 float32 matmul"
    ours = r["kvserve"]
    positive(ours["decode"], "tok_s", "step_ms", "bytes_read_per_step", "mbu")
    positive(ours["prefill"], "tok_s", "flops", "mfu")
    assert ours["prefill"]["tokens"] == 32
    positive(ours["split"], "prefill_s", "decode_s", "decode_ms_per_token")
    assert 0 < ours["split"]["decode_share"] < 1
    assert ours["decode"]["mbu"] == pytest.approx(
        ours["decode"]["achieved_read_gbps"] / r["copy_bandwidth"]["gbps"])
    assert "transformers" not in r  # --transformers is off unless asked for
    # `kvserve estimate --calibrate` takes the first mbu/mfu it finds: kvserve's
    from kvserve.benchmarks.client.estimate import find_number
    assert find_number(r, "mbu") == ours["decode"]["mbu"]
    assert find_number(r, "mfu") == ours["prefill"]["mfu"]
    table = capsys.readouterr().out
    assert "MBU" in table and "MFU" in table and "prefill tok/s (32 tokens)" in table


def test_bench_offline_on_a_checkpoint_directory(tmp_path, tiny_model_dir):
    out = tmp_path / "offline.json"
    cli.main(["bench", "offline", "--model", str(tiny_model_dir()), "--device", "cpu",
              "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
              "--num-kv-blocks", "16", "--temperature", "0", "--compile", "off",
              "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["load_format"] == "safetensors" and r["output_tokens"] == 8


def test_preset_without_random_weights_is_a_clear_error():
    with pytest.raises(SystemExit, match="add --load-format random"):
        cli.main(["bench", "decode", "--model", "preset:llama-tiny"])


# -- the arithmetic ------------------------------------------------------------------
def hand_config(tied: bool = False) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8,
                       intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=4, rms_norm_eps=1e-5, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def test_prefill_flops_by_hand():
    cfg = hand_config()
    # per layer: q,k,v,o 8*4*(2*2 + 2*1) = 192, MLP 3*8*16 = 384
    assert matmul_params(cfg) == 2 * (192 + 384) == 1152
    # 4 layers-heads-widths: 4 * 2 layers * (2 heads * 4) = 64 FLOPs per key attended
    assert attention_flops(cfg, 10) == 640
    # 4 tokens: 2 * 1152 * 4 matmuls, the head once (2 * 10 * 8), keys 1+2+3+4 = 10
    assert prefill_flops(cfg, 4) == 9216 + 160 + 640


def test_matmul_params_of_llama_3_1_8b():
    """With both embedding tables and the norms, the published 8,030,261,248."""
    cfg = ModelConfig.from_pretrained("preset:llama-3.1-8b")
    norms = cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size
    assert matmul_params(cfg) + 2 * cfg.vocab_size * cfg.hidden_size + norms == 8_030_261_248


def test_bytes_per_decode_step_by_hand():
    import torch

    untied = bytes_per_decode_step(hand_config(), torch.bfloat16, context=10)
    # weights: 1152 matmul + 2*2*8 layer norms + 8 final norm + head 80 + one embedding row 8
    assert untied["weights"] == (1152 + 32 + 8 + 80 + 8) * 2
    assert untied["kv"] == 2 * 2 * 1 * 4 * 2 * 10  # K and V, layers, kv heads, dim, bytes
    tied = bytes_per_decode_step(hand_config(tied=True), torch.bfloat16, context=10)
    # one table, read whole as the head (the embedding row is part of it)
    assert tied["weights"] == (1152 + 32 + 8 + 80) * 2
    # An fp8 cache: the same weights, one byte a K or V value.
    fp8 = bytes_per_decode_step(hand_config(), torch.bfloat16, context=10,
                                kv_dtype=torch.float8_e4m3fn)
    assert fp8["weights"] == untied["weights"] and fp8["kv"] == untied["kv"] // 2


def test_mbu_and_mfu_by_hand():
    # 1 GB read in 10 ms is 100 GB/s: half of a 200 GB/s copy bandwidth
    assert mbu(1e9, 0.01, 200.0) == pytest.approx(0.5)
    # 989 TFLOP/s peak, 1.4835e15 FLOPs in 3 s: 494.5 TFLOP/s achieved
    assert mfu(1.4835e15, 3.0, 989.0) == pytest.approx(0.5)
    assert mfu(2e12, 1.0, 4.0) == pytest.approx(0.5)


@pytest.mark.parametrize("name,expected", [
    ("NVIDIA H100 80GB HBM3", ("H100", 989.0)), ("NVIDIA H100 PCIe", ("H100", 989.0)),
    ("NVIDIA H200", ("H200", 989.0)), ("NVIDIA A100-SXM4-80GB", ("A100", 312.0)),
    ("NVIDIA L40S", ("L40S", 362.0)), ("NVIDIA A10G", ("A10G", 70.0)),
    ("NVIDIA GeForce RTX 4090", ("RTX 4090", 165.0)), ("Tesla T4", None),
])
def test_gpu_peak_table(name, expected):
    assert table_peak_tflops(name) == expected


def test_cpu_peak_is_measured():
    import torch

    peak = peak_tflops(torch.device("cpu"), torch.float32, 64, repeats=2)
    assert peak["tflops"] > 0 and peak["source"] == "measured: 64x64 float32 matmul"


# -- routing -------------------------------------------------------------------------
def test_bench_tools_are_routed(monkeypatch):
    import kvserve.benchmarks.client.cli
    import kvserve.benchmarks.in_process.cli

    calls = []
    monkeypatch.setattr(kvserve.benchmarks.in_process.cli, "main", lambda argv: calls.append(
        ("engine", argv)) or 0)
    monkeypatch.setattr(kvserve.benchmarks.client.cli, "main", lambda argv: calls.append(
        ("client", argv)) or 0)
    for argv in (["bench", "decode", "--model", "x"], ["bench", "offline"],
                 ["bench", "serve", "--base-url", "u"], ["bench", "plot", "a.json"],
                 ["estimate", "--model", "m"]):
        cli.main(argv)
    assert calls == [("engine", ["decode", "--model", "x"]), ("engine", ["offline"]),
                     ("client", ["bench", "serve", "--base-url", "u"]),
                     ("client", ["bench", "plot", "a.json"]),
                     ("client", ["estimate", "--model", "m"])]


def test_serve_imports_no_benchmark_package():
    code = ("import sys; from kvserve.server.entrypoints import cli; "
            "cli.build_parser().parse_args(['serve']); print(sorted(m for m in sys.modules "
            "if m.startswith(('bench', 'kvserve.benchmarks', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_bench_provenance_still_importable():
    from kvserve.benchmarks.provenance import provenance

    info = provenance("some GPU")
    assert info["device"] == "some GPU" and {"commit", "command", "python"} <= set(info)


def test_bench_profile_end_to_end(tmp_path, capsys, frozen_heap):
    """`kvserve bench profile`, eager only (the compiled forward pass has tests of its
    own): every bucket of a step's time is there and accounts for the step."""
    out = tmp_path / "profile.json"
    assert cli.main(["bench", "profile", *TINY, "--dtypes", "float32", "--modes", "eager",
                     "--batch-sizes", "1,3", "--steps", "3", "--kernels", "2",
                     "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["command"].startswith("kvserve bench profile")
    positive(r["copy_bandwidth"], "gbps")
    assert [(c["dtype"], c["forward"], c["batch"]) for c in r["cases"]] == [
        ("float32", "eager", 1), ("float32", "eager", 3)]
    for case in r["cases"]:
        positive(case, "step_ms", "tok_s", "floor_ms")
        split = case["split_ms"]
        assert set(split) == {"matmuls", "compiled graph", "attn gather", "attn compute",
                              "elementwise", "dispatch", "sampler", "host"}
        assert split["matmuls"] > 0 and split["compiled graph"] == 0  # eager
        assert split["attn gather"] > 0  # the reference backend copies each context
        # The profiled steps run slower than the timed ones, never several times over.
        assert sum(split.values()) < 5 * case["step_ms"]
        assert len(case["kernels"]) == 2
        assert all(k["ms_per_step"] > 0 and k["name"] for k in case["kernels"])
    printed = capsys.readouterr().out
    assert "attn gather" in printed and "costliest ops and kernels" in printed


def test_decode_split_end_to_end(tmp_path):
    """bench/decode_split.py on the tiny model, eager, three requests decoding
    together: the step, its parts (each no longer than the step), the ops the
    profiler saw and the linear layers' FLOPs for three rows, as JSON."""
    out = tmp_path / "split.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "decode_split.py"),
                    "--model", "preset:llama-tiny", "--load-format", "random",
                    "--dtype", "float32", "--compile", "off", "--prompt-len", "16",
                    "--steps", "4", "--batch", "3", "--json", str(out)], check=True,
                   cwd=ROOT, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["steps"] == 4 and r["compile"] == "off" and r["weight_bytes"] > 0
    # llama-tiny: 2 layers of hidden 64, 4 heads and 2 KV heads of 16, MLP 128, vocab 1024
    per_row = 2 * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 128) + 1024 * 64
    assert r["batch"] == 3 and r["linear_gflop_per_step"] == pytest.approx(6 * per_row / 1e9)
    assert 0 < r["split_ms"]["forward"] <= r["step_ms"]
    assert all(0 <= v <= r["step_ms"] for v in r["split_ms"].values())
    assert r["ops_ms_per_step"] and r["decode_gb_per_s"] > 0


def test_prefill_split_end_to_end(tmp_path):
    """bench/prefill_split.py on the tiny model, eager: five prompts of 40 tokens
    through the engine's steps, their rate, the steps' parts (each no longer than a
    step), page faults counted and the ops the profiler saw, as JSON."""
    out = tmp_path / "prefill.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "prefill_split.py"),
                    "--model", "preset:llama-tiny", "--load-format", "random",
                    "--dtype", "float32", "--compile", "off", "--prompts", "5",
                    "--prompt-len", "40", "--json", str(out)], check=True,
                   cwd=ROOT, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["prompts"] == 5 and r["prompt_len"] == 40 and r["steps"] >= 1
    assert r["prompt_tok_per_s"] == pytest.approx(200 / r["seconds"])
    assert 0 < r["split_ms"]["forward"] <= r["step_ms"]
    assert all(0 <= v <= r["step_ms"] for v in r["split_ms"].values())
    assert r["page_faults_per_step"] >= 0 and r["decoder_linear_gmac_per_s_of_forward"] > 0
    assert r["ops_ms_per_step"]


@pytest.mark.parametrize("kind", ["int4", "int8", "bf16"])
def test_decode_layers_end_to_end(tmp_path, kind):
    """bench/decode_layers.py on a tiny shape: the bytes a step reads (int4: half a
    byte a weight plus a float16 scale and minimum per 32) and its GB/s."""
    from kvserve.engine.kernels.cpu.bf16_pairs import bf16_pairs_here

    if kind == "bf16" and not bf16_pairs_here():
        pytest.skip("bf16 pair panels need AVX512-BF16 (an AVX2-only CPU has none)")
    out = tmp_path / "layers.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "decode_layers.py"), "--kind", kind,
                    "--shape", "tiny", "--steps", "3", "--json", str(out)], check=True,
                   cwd=ROOT, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    weights = 2 * (384 * 256 + 256 * 256 + 1024 * 256 + 256 * 512)
    if kind == "int4":
        assert r["weight_bytes"] == weights // 2 + weights // 32 * 4
    assert r["weight_bytes"] > 0 and r["best_ms"] <= r["median_ms"]
    assert r["best_gb_per_s"] == pytest.approx(r["weight_bytes"] / r["best_ms"] / 1e6)
