"""The `kvserve` command line: sizes, KVSERVE_* environment defaults, model checks."""
from __future__ import annotations

import argparse
import os

import pytest

from kvserve.engine.config.arg_types import parse_size
from kvserve.server.entrypoints import cli
from kvserve.server.entrypoints.cli import build_parser, engine_config_from_args, resolve_model

GiB, MiB, KiB = 2**30, 2**20, 2**10


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("KVSERVE_") and key != "KVSERVE_CACHE":
            monkeypatch.delenv(key)


@pytest.mark.parametrize("text,expected", [
    ("1GiB", GiB), ("1gib", GiB), ("1G", GiB), ("2g", 2 * GiB), ("1GB", GiB),
    ("512M", 512 * MiB), ("512MiB", 512 * MiB), ("512mb", 512 * MiB),
    ("64k", 64 * KiB), ("64KiB", 64 * KiB), ("1T", 2**40), ("1TiB", 2**40),
    ("1073741824", GiB), ("100", 100), ("100B", 100), ("1.5GiB", 3 * GiB // 2),
    ("0.5g", GiB // 2), (" 1 GiB ", GiB), ("0", 0),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected
    assert isinstance(parse_size(text), int)


@pytest.mark.parametrize("text", ["", "GiB", "abc", "-1G", "1X", "1GiBs", "1 2G", "1.2.3G",
                                  ".", "1e9"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size(text)


def test_defaults_without_env():
    args = build_parser().parse_args(["serve"])
    assert args.command == "serve"
    assert args.model is None
    assert args.host == "127.0.0.1"
    assert args.port == 8000
    assert args.kv_cache_memory is None  # 1 GiB on CPU, profiled on CUDA
    assert args.gpu_memory_utilization == 0.9
    assert args.block_size == 16
    assert args.max_model_len is None
    assert args.enable_prefix_caching is True
    assert args.log_level == "info"


def test_env_defaults_override(monkeypatch):
    monkeypatch.setenv("KVSERVE_PORT", "9123")
    monkeypatch.setenv("KVSERVE_HOST", "0.0.0.0")
    monkeypatch.setenv("KVSERVE_KV_CACHE_MEMORY", "512MiB")
    monkeypatch.setenv("KVSERVE_MAX_MODEL_LEN", "2048")
    monkeypatch.setenv("KVSERVE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("KVSERVE_SERVED_MODEL_NAME", "a,b")
    monkeypatch.setenv("KVSERVE_MAX_NUM_SEQS", "8")
    args = build_parser().parse_args(["serve"])
    assert args.port == 9123
    assert args.host == "0.0.0.0"
    assert args.kv_cache_memory == 512 * MiB
    assert args.max_model_len == 2048
    assert args.enable_prefix_caching is False
    assert args.served_model_name == "a,b"
    assert args.max_num_seqs == 8


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("YES", True),
                                            ("on", True), ("0", False), ("no", False)])
def test_env_bool(monkeypatch, value, expected):
    monkeypatch.setenv("KVSERVE_ENABLE_PREFIX_CACHING", value)
    assert build_parser().parse_args(["serve"]).enable_prefix_caching is expected


def test_flags_beat_env(monkeypatch):
    monkeypatch.setenv("KVSERVE_PORT", "9123")
    monkeypatch.setenv("KVSERVE_KV_CACHE_MEMORY", "512MiB")
    args = build_parser().parse_args(["serve", "--port", "7000", "--kv-cache-memory", "2G"])
    assert args.port == 7000
    assert args.kv_cache_memory == 2 * GiB


def test_env_shown_in_help(monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_PORT", "9123")
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "KVSERVE_PORT" in out and "9123" in out


@pytest.mark.parametrize("env,value,flag", [("KVSERVE_PORT", "abc", "--port"),
                                            ("KVSERVE_KV_CACHE_MEMORY", "lots",
                                             "--kv-cache-memory")])
def test_bad_env_value_is_a_clear_usage_error(monkeypatch, capsys, env, value, flag):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and value in err


def test_bad_flag_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--kv-cache-memory", "lots"])
    assert exc.value.code == 2
    assert "--kv-cache-memory" in capsys.readouterr().err


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([])
    assert exc.value.code == 2


def test_missing_model_dir_exits_with_clear_message(tmp_path):
    missing = tmp_path / "no-such-model"
    args = build_parser().parse_args(["serve", "--model", str(missing)])
    with pytest.raises(SystemExit) as exc:
        resolve_model(args)
    msg = str(exc.value.code)
    assert "model directory not found" in msg and str(missing) in msg


def test_main_with_missing_model_dir_exits(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--model", str(missing), "--log-level", "warning"])
    assert "model directory not found" in str(exc.value.code)


def test_main_with_model_dir_without_config_exits(tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--model", str(tmp_path), "--log-level", "warning"])
    msg = str(exc.value.code)
    assert msg.startswith("kvserve:") and "config.json" in msg


def test_resolve_model_names(tmp_path):
    args = build_parser().parse_args(["serve", "--model", str(tmp_path)])
    assert resolve_model(args) == (str(tmp_path), [str(tmp_path)])
    args = build_parser().parse_args(["serve", "--model", str(tmp_path),
                                      "--served-model-name", " a, b ,,"])
    assert resolve_model(args) == (str(tmp_path), ["a", "b"])


def test_engine_config_from_args(tmp_path):
    args = build_parser().parse_args([
        "serve", "--model", str(tmp_path), "--dtype", "float32", "--device", "cpu",
        "--max-model-len", "1024", "--block-size", "32", "--kv-cache-memory", "256MiB",
        "--num-kv-blocks", "100", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
        "--enable-prefix-caching", "no", "--load-format", "random", "--seed", "3"])
    cfg = engine_config_from_args(args, str(tmp_path))
    assert cfg.model == str(tmp_path)
    assert (cfg.dtype, cfg.device, cfg.max_model_len, cfg.block_size) == (
        "float32", "cpu", 1024, 32)
    assert (cfg.kv_cache_memory, cfg.num_kv_blocks, cfg.max_num_seqs) == (256 * MiB, 100, 4)
    assert cfg.max_num_batched_tokens == 128
    assert cfg.enable_prefix_caching is False
    assert (cfg.load_format, cfg.seed) == ("random", 3)


@pytest.mark.parametrize("flag, value", [("--scheduling-policy", "lifo"), ("--dtype", "fp8"),
                                         ("--load-format", "pickle")])
def test_invalid_choices_are_usage_errors_before_loading(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", flag, value])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
