"""The deployment files as data: the Dockerfile's instructions per stage, the
compose file, the Grafana dashboard and its provisioning."""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvserve.json"


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTR, args)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]

    def env(self) -> dict[str, str]:
        """ENV KEY=value pairs (several per line allowed), later ones winning."""
        out = {}
        for line in self.args("ENV"):
            for pair in shlex.split(line):
                key, _, value = pair.partition("=")
                out[key] = value
        return out


def dockerfile_stages(path: Path = ROOT / "Dockerfile") -> list[Stage]:
    """Comments dropped, continuation lines joined; ARGs before the first FROM are
    substituted into the FROM lines."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages, global_args = [], {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default
        elif instr == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args.get(m.group(1), ""), rest)
            stages.append(Stage(base))
        elif stages:
            stages[-1].instructions.append((instr, rest))
    return stages


def exec_form(args: str) -> list[str]:
    """CMD / ENTRYPOINT / HEALTHCHECK CMD in JSON (exec) form."""
    return json.loads(args)


def compose() -> dict:
    """The file as written: variables not substituted (compose_as_run does that)."""
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


# What .env would hold: the two secrets compose requires.
SECRETS = {"KVSERVE_API_KEY": "test-key", "GRAFANA_ADMIN_PASSWORD": "test-password"}

_VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?[-?+])([^}]*))?\}|(\w+))")


class MissingVariable(ValueError):
    """A ${NAME:?message} or ${NAME?message} whose variable is not set."""


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's substitution: $$, $NAME, ${NAME}, ${NAME:-default} (unset or empty),
    ${NAME-default} (unset), ${NAME:?message} / ${NAME?message} (an error),
    ${NAME:+other} / ${NAME+other}."""
    def one(m: re.Match) -> str:
        escaped, name, op, arg, bare = m.groups()
        if escaped:
            return "$"
        if bare:
            return env.get(bare, "")
        value = env.get(name)
        if op is None:
            return value or ""
        unset = value is None or (op.startswith(":") and value == "")
        if op.endswith("-"):
            return arg if unset else value
        if op.endswith("?"):
            if unset:
                raise MissingVariable(f"{name}: {arg}")
            return value
        return "" if unset else arg  # + and :+
    return _VARIABLE.sub(one, text)


def compose_as_run(env: dict[str, str] | None = None) -> dict:
    """The file as `docker compose` reads it with `env` as its environment and .env
    (default: the secrets set, nothing else): every string value substituted."""
    env = SECRETS if env is None else env

    def walk(node):
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return interpolate(node, env) if isinstance(node, str) else node
    return walk(compose())


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_targets(dash: dict | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every query in the dashboard."""
    dash = dash or dashboard()
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def provisioning(kind: str) -> dict:
    folder = DEPLOY / "grafana" / "provisioning" / kind
    (path,) = folder.glob("*.yml")
    return yaml.safe_load(path.read_text())
