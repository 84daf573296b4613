"""Every setting is declared once, as a config field (engine/config/settings.py): each
field of the engine's, the speculative and the server's config has help text, a
`kvserve serve` flag and a KVSERVE_* variable, and the command line has no flag
that is not such a field."""
from __future__ import annotations

import dataclasses

import pytest

from kvserve.engine.config.arg_types import parse_bool, parse_size
from kvserve.engine.config.engine_config import EngineConfig, SpeculativeConfig
from kvserve.engine.config.kv_events_config import KVEventsConfig, parse_flag
from kvserve.engine.config.kv_transfer_config import KVTransferConfig
from kvserve.engine.config.kv_transfer_config import parse_flag as parse_transfer_flag
from kvserve.engine.config.lora_config import LoRAConfig
from kvserve.engine.config.settings import dest_name, env_name, flag_name, from_args, settings_of
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.cli import build_parser

CONFIGS = [EngineConfig, SpeculativeConfig, LoRAConfig, ServerConfig]
SETTINGS = [(cls, f) for cls in CONFIGS for f in settings_of(cls)
            if f.metadata["nested"] is None]


def _serve_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]


@pytest.mark.parametrize("cls", CONFIGS)
def test_every_config_field_is_a_setting_with_help(cls):
    for f in dataclasses.fields(cls):
        assert "help" in f.metadata, f"{cls.__name__}.{f.name} is not declared a setting"
        assert len(f.metadata["help"]) > 10, f"{cls.__name__}.{f.name} has no help text"


def test_the_flags_are_exactly_the_settings():
    flags = {opt for action in _serve_parser()._actions for opt in action.option_strings}
    assert flags - {"-h", "--help"} == {flag_name(f) for _, f in SETTINGS}
    assert len({flag_name(f) for _, f in SETTINGS}) == len(SETTINGS)  # none twice


def test_help_names_each_flags_environment_variable():
    text = _serve_parser().format_help().replace("\n", " ")
    for _, f in SETTINGS:
        assert flag_name(f) in text and env_name(flag_name(f)) in text


def _sample(f) -> tuple[str, object]:
    """A value for the setting that is not its default: (env text, parsed value)."""
    meta = f.metadata
    if meta["secret_list"]:
        return "a, b", ["a", "b"]
    if meta["many"]:  # --lora-modules
        return "a=/x b=/y", [("a", "/x"), ("b", "/y")]
    if meta["choices"]:
        return str(meta["choices"][-1]), meta["choices"][-1]
    parse = meta["parse"]
    if parse is parse_bool:
        return ("false", False) if f.default else ("true", True)
    if parse is parse_size:
        return "1MiB", 2**20
    if parse is str:
        return "some-text", "some-text"
    if parse is parse_flag:
        text = '{"enable_kv_cache_events": true, "topic": "kv"}'
        return text, KVEventsConfig(enable_kv_cache_events=True, topic="kv")
    if parse is parse_transfer_flag:
        return '{"kv_role": "kv_producer"}', KVTransferConfig(kv_role="kv_producer")
    value = 7 if parse(str(7)) == 7 else 0.5  # an int flag or a float one
    return str(value), parse(str(value))


@pytest.mark.parametrize("cls, f", SETTINGS, ids=lambda x: getattr(x, "name", ""))
def test_each_environment_variable_sets_its_flags_default(monkeypatch, cls, f):
    text, value = _sample(f)
    monkeypatch.setenv(env_name(flag_name(f)), text)
    args = build_parser().parse_args(["serve"])
    assert getattr(args, dest_name(f)) == value


def test_the_configs_come_back_from_the_flags():
    args = build_parser().parse_args([
        "serve", "--max-num-seqs", "3", "--speculative-method", "ngram",
        "--num-speculative-tokens", "2", "--api-key", "k1,k2", "--port", "9"])
    engine = from_args(EngineConfig, args, model="/m")
    assert engine == EngineConfig("/m", max_num_seqs=3,
                                  speculative=SpeculativeConfig("ngram", num_tokens=2))
    assert from_args(ServerConfig, args) == ServerConfig(api_keys=["k1", "k2"], port=9)
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x",
                                      "b=/y", "--lora-modules", "c=/z", "--max-loras", "2"])
    assert from_args(EngineConfig, args, model="/m").lora == LoRAConfig(
        True, (("a", "/x"), ("b", "/y"), ("c", "/z")), max_loras=2)
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules",
                                      '{"name": "j", "path": "/j", "base_model_name": "m"}'])
    assert from_args(EngineConfig, args, model="/m").lora.modules == (("j", "/j"),)
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/x"])
    with pytest.raises(ValueError, match="--enable-lora"):
        from_args(EngineConfig, args, model="/m")
    with pytest.raises(SystemExit):  # not name=path: a usage error naming the flag
        build_parser().parse_args(["serve", "--lora-modules", "a"])
    defaults = build_parser().parse_args(["serve"])
    assert from_args(EngineConfig, defaults, model="/m") == EngineConfig("/m")
    assert from_args(ServerConfig, defaults) == ServerConfig()
