"""docker-compose.yml, checked without a Docker engine: it validates against the
Compose JSON schema, and the parts that make the stack work are there (the GPU
reserved, start in order of health, the mounts the other files expect), and its
defaults are safe on a shared host: ports published on 127.0.0.1 only, the API key
and Grafana's password taken from .env (required, no default), no KV cache events
port published.

compose_spec.json is the schema that docker-compose 1.29.2 (PyPI, Apache-2.0)
ships as compose/config/compose_spec.json, copied unchanged; newer Compose accepts
more keys, so a file valid here is valid there too."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from tests.deploy.files import (ROOT, SECRETS, MissingVariable, compose, compose_as_run,
                                dockerfile_stages, interpolate, provisioning)

SCHEMA = Path(__file__).with_name("compose_spec.json")


def test_validates_against_the_compose_schema():
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator(schema).validate(compose())


def test_the_schema_catches_a_mistake():
    broken = compose()
    broken["services"]["kvserve"]["healthcheck"]["intervall"] = "5s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).validate(broken)


def test_kvserve_reserves_an_nvidia_gpu():
    devices = compose()["services"]["kvserve"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_services_start_in_order_of_health():
    services = compose()["services"]
    assert services["prometheus"]["depends_on"] == {"kvserve": {"condition": "service_healthy"}}
    assert services["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name


def _mounts(service: str) -> dict[str, str]:
    """container path -> host path (or volume name)."""
    return {m.split(":")[1]: m.split(":")[0] for m in compose()["services"][service]["volumes"]}


def test_the_cache_volume_is_where_the_image_keeps_the_model():
    cache = dockerfile_stages()[-1].env()["KVSERVE_CACHE"]
    assert _mounts("kvserve")[cache] in compose()["volumes"]


def test_grafana_mounts_its_provisioning_and_the_dashboard():
    mounts = _mounts("grafana")
    assert (ROOT / mounts["/etc/grafana/provisioning"] / "datasources").is_dir()
    path = provisioning("dashboards")["providers"][0]["options"]["path"]
    assert (ROOT / mounts[path] / "kvserve.json").is_file()
    home = compose()["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/kvserve.json"
    assert compose_as_run()["services"]["grafana"]["ports"] == ["127.0.0.1:3000:3000"]


def test_prometheus_scrapes_the_kvserve_service():
    mounts = _mounts("prometheus")
    config = ROOT / mounts["/etc/prometheus/prometheus.yml"]
    import yaml

    (job,) = yaml.safe_load(config.read_text())["scrape_configs"]
    port = compose()["services"]["kvserve"]["environment"]["KVSERVE_PORT"]
    assert job["static_configs"][0]["targets"] == [f"kvserve:{port}"]
    if shutil.which("promtool"):  # Debian's prometheus package ships it
        proc = subprocess.run(["promtool", "check", "config", str(config)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_replicas_profile_puts_two_replicas_behind_the_router():
    from kvserve.engine.config.kv_events_config import KVEventsConfig

    services = compose()["services"]
    profiled = {n for n, s in services.items() if "replicas" in s.get("profiles", [])}
    assert profiled == {"kvserve-a", "kvserve-b", "router"}
    command = services["router"]["command"]
    assert "--policy=cache_aware" in command
    assert "--health-check-endpoint=/ready" in command  # no traffic while compiling
    assert {"http://kvserve-a:8000", "http://kvserve-b:8000"} <= set(command)
    gpus = [services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for n in ("kvserve-a", "kvserve-b")]
    assert gpus[0] != gpus[1]
    # Its policy reads request text: the replicas publish no KV cache events (every
    # tenant's token ids) for nobody to read.
    for name in ("kvserve-a", "kvserve-b"):
        env = services[name]["environment"]
        assert "KVSERVE_KV_EVENTS_CONFIG" not in env
    # The line a kv_aware router needs, commented out, still parses.
    (line,) = re.findall(r"# KVSERVE_KV_EVENTS_CONFIG: '(.*)'",
                         (ROOT / "docker-compose.yml").read_text())
    assert KVEventsConfig.parse(line).enable_kv_cache_events
    assert services["router"]["depends_on"] == {
        n: {"condition": "service_healthy"} for n in ("kvserve-a", "kvserve-b")}
    assert (ROOT / services["router"]["build"] / "Dockerfile").is_file()


def _published(service: dict) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each published port. Without an
    address Docker binds every interface: "" here."""
    out = []
    for port in service.get("ports", []):
        parts = str(port).rsplit(":", 2)
        out.append(tuple([""] * (3 - len(parts)) + parts))
    return out


def test_every_published_port_binds_loopback_by_default():
    services = compose_as_run()["services"]
    published = {name: _published(s) for name, s in services.items() if "ports" in s}
    assert set(published) == {"kvserve", "prometheus", "grafana", "router"}
    for name, ports in published.items():
        for address, _, _ in ports:
            assert address == "127.0.0.1", (name, ports)
    # KVSERVE_BIND (documented in .env.example) opens them all at once.
    wide = compose_as_run({**SECRETS, "KVSERVE_BIND": "0.0.0.0"})["services"]
    for name in published:
        assert {a for a, _, _ in _published(wide[name])} == {"0.0.0.0"}, name


def test_no_service_publishes_the_kv_events_port():
    for name, service in compose_as_run()["services"].items():
        ports = {p for _, host, container in _published(service) for p in (host, container)}
        assert "5557" not in ports, name
        assert "5557" not in {str(p) for p in service.get("expose", [])}, name


def test_the_api_key_and_grafanas_password_come_from_the_environment():
    raw = compose()["services"]
    kvserves = ("kvserve", "kvserve-a", "kvserve-b")
    # Every replica takes the key; nothing has a password or key written in the file.
    for name in kvserves:
        key = raw[name]["environment"]["KVSERVE_API_KEY"]
        assert re.fullmatch(r"\$\{KVSERVE_API_KEY:\?.+\}", key), name
    password = raw["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?.+\}", password)
    # Required: compose refuses to start with either unset or empty (no admin/admin).
    for missing in SECRETS:
        for env in ({k: v for k, v in SECRETS.items() if k != missing}, {**SECRETS, missing: ""}):
            with pytest.raises(MissingVariable, match=missing):
                compose_as_run(env)
    run = compose_as_run()["services"]
    assert {run[n]["environment"]["KVSERVE_API_KEY"] for n in kvserves} == {"test-key"}
    assert run["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "test-password"


def test_env_example_names_every_variable_and_holds_no_secret():
    text = (ROOT / "docker-compose.yml").read_text()
    used = set(re.findall(r"\$\{(\w+)", text))
    example = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            example[key] = value
    assert used == set(example)
    assert all(example[k] == "" for k in SECRETS)
    assert interpolate("${KVSERVE_BIND:-127.0.0.1}", {}) == example["KVSERVE_BIND"]
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert ".env" in ignored and ".env" in (ROOT / ".dockerignore").read_text().splitlines()
