"""What the container runs is the real CLI: every KVSERVE_* variable that the
Dockerfile or the compose file sets is a `kvserve serve` flag, and parsing the
entrypoint's command line with those variables gives what the flags would give."""
from __future__ import annotations

import argparse

import pytest

from kvserve.server.entrypoints.cli import build_parser
from tests.deploy.files import compose_as_run, dockerfile_stages, exec_form

NOT_FLAGS = {"KVSERVE_CACHE"}  # modelstore/default_model.py's cache root, not a flag


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _flag(env_name: str) -> str:
    return "--" + env_name[len("KVSERVE_"):].lower().replace("_", "-")


def _container_env() -> dict[str, str]:
    env = {k: v for k, v in dockerfile_stages()[-1].env().items() if k.startswith("KVSERVE_")}
    service = compose_as_run()["services"]["kvserve"]
    env.update({k: str(v) for k, v in service["environment"].items()})
    return {k: v for k, v in env.items() if k not in NOT_FLAGS}


def _command_line() -> list[str]:
    final = dockerfile_stages()[-1]
    argv = exec_form(final.args("ENTRYPOINT")[-1]) + exec_form(final.args("CMD")[-1])
    argv += compose_as_run()["services"]["kvserve"].get("command", [])
    assert argv[0] == "kvserve"
    return argv[1:]


def test_every_variable_is_a_serve_flag():
    flags = _serve_parser()._option_string_actions
    for name in _container_env():
        assert _flag(name) in flags, f"{name}: kvserve serve has no {_flag(name)}"


def test_the_environment_parses_as_the_flags_would(monkeypatch):
    env = _container_env()
    flags = [x for name, value in env.items() for x in (_flag(name), value)]
    for name in list(env):
        monkeypatch.delenv(name, raising=False)
    explicit = build_parser().parse_args(_command_line() + flags)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from_env = build_parser().parse_args(_command_line())
    assert vars(from_env) == vars(explicit)
    assert (from_env.command, from_env.host, from_env.port) == ("serve", "0.0.0.0", 8000)


@pytest.mark.parametrize("where", ["healthcheck", "ports"])
def test_the_port_is_the_same_everywhere(where):
    service = compose_as_run()["services"]["kvserve"]
    port = _container_env()["KVSERVE_PORT"]
    if where == "ports":
        assert any(str(p).endswith(f":{port}") for p in service["ports"])
    else:
        assert f"127.0.0.1:{port}/ready" in " ".join(service["healthcheck"]["test"])
