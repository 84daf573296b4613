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
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


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
