"""CLI flags of the operational features: --api-key, --max-waiting-requests,
--shutdown-timeout, --tool-call-parser (and their KVSERVE_* environment defaults)."""
from __future__ import annotations

import os

import pytest

from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints import cli
from kvserve.server.entrypoints.cli import build_parser


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("KVSERVE_") and key != "KVSERVE_CACHE":
            monkeypatch.delenv(key)


def _args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults():
    args = _args()
    assert (args.api_key, args.max_waiting_requests, args.shutdown_timeout) == ([], 0, 30.0)


def test_api_keys_repeated_and_comma_separated():
    args = _args("--api-key", "a, b", "--api-key", "c", "--api-key", ",")
    assert args.api_key == ["a", "b", "c"]


def test_api_keys_from_env_and_flags_replace_them(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "env-1,env-2")
    assert _args().api_key == ["env-1", "env-2"]
    assert _args("--api-key", "flag").api_key == ["flag"]
    assert _args().api_key == ["env-1", "env-2"]  # the default list was not mutated


def test_help_never_shows_a_key(monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_API_KEY", "sup3r-secret")
    with pytest.raises(SystemExit):
        _args("--help")
    out = capsys.readouterr().out
    assert "KVSERVE_API_KEY" in out and "sup3r-secret" not in out


def test_limits_from_env(monkeypatch):
    monkeypatch.setenv("KVSERVE_MAX_WAITING_REQUESTS", "7")
    monkeypatch.setenv("KVSERVE_SHUTDOWN_TIMEOUT", "2.5")
    args = _args()
    assert (args.max_waiting_requests, args.shutdown_timeout) == (7, 2.5)


@pytest.mark.parametrize("flag,value", [("--max-waiting-requests", "-1"),
                                        ("--max-waiting-requests", "x"),
                                        ("--shutdown-timeout", "-0.5")])
def test_negative_or_bad_limits_are_usage_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        _args(flag, value)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_serve_wires_the_flags_through(monkeypatch, tmp_path):
    """serve() hands the keys and the queue limit to build_app, and the drain timeout
    to the graceful server (the shutdown tests run the real thing)."""
    import kvserve.engine.client.async_engine
    import kvserve.engine.core.engine
    import kvserve.server.entrypoints.app
    import kvserve.server.shutdown

    seen = {}

    class FakeApp:
        class state:
            admission = "the-admission"

    def fake_build_app(engine, names, model_root="", **kw):
        seen["app"] = kw
        return FakeApp

    class FakeServer:
        engine_died = False

        def __init__(self, config, admission, timeout):
            seen["server"] = (config.app, admission, timeout)
            seen["keep_alive"] = config.timeout_keep_alive
            seen["connections"] = config.limit_concurrency

        def run(self):
            seen["ran"] = True

    monkeypatch.setattr(kvserve.engine.core.engine, "Engine", lambda config: object())
    monkeypatch.setattr(kvserve.engine.client.async_engine, "AsyncEngine", lambda e: e)
    monkeypatch.setattr(kvserve.server.entrypoints.app, "build_app", fake_build_app)
    monkeypatch.setattr(kvserve.server.shutdown, "GracefulServer", FakeServer)
    cli.serve(_args("--model", str(tmp_path), "--engine-mode", "thread", "--api-key", "k1,k2",
                    "--max-waiting-requests", "5", "--shutdown-timeout", "3",
                    "--max-waiting-tokens", "7", "--max-request-body-bytes", "100",
                    "--max-prompts-per-request", "2", "--max-n", "4",
                    "--request-timeout", "1.5", "--protect-metrics", "true",
                    "--timeout-keep-alive", "65", "--max-connections", "50",
                    "--body-read-timeout", "7"))
    assert seen["app"] == {"config": ServerConfig(
        engine_mode="thread", api_keys=["k1", "k2"], max_waiting_requests=5, max_waiting_tokens=7,
        max_request_body_bytes=100, max_prompts_per_request=2, max_n=4,
        request_timeout=1.5, protect_metrics=True, timeout_keep_alive=65,
        shutdown_timeout=3, max_connections=50, body_read_timeout=7)}
    assert seen["server"] == (FakeApp, "the-admission", 3.0)
    assert seen["keep_alive"] == 65 and seen["connections"] == 50
    assert seen["ran"]


def test_tool_call_parser_is_one_of_the_formats(capsys):
    assert _args().tool_call_parser == "auto"
    assert _args("--tool-call-parser", "mistral").tool_call_parser == "mistral"
    with pytest.raises(SystemExit):
        _args("--tool-call-parser", "pythonic")
