"""docker-compose.yml, checked without a Docker engine: it validates against the
Compose JSON schema, and the parts that make the stack work are there (the GPU
reserved, start in order of health, the mounts the other files expect).

compose_spec.json is the schema that docker-compose 1.29.2 (PyPI, Apache-2.0)
ships as compose/config/compose_spec.json, copied unchanged; newer Compose accepts
more keys, so a file valid here is valid there too."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from tests.deploy.files import ROOT, compose, dockerfile_stages, provisioning

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
    assert compose()["services"]["grafana"]["ports"] == ["3000:3000"]


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
    from engine.kv_events.config import KVEventsConfig

    services = compose()["services"]
    profiled = {n for n, s in services.items() if "replicas" in s.get("profiles", [])}
    assert profiled == {"kvserve-a", "kvserve-b", "router"}
    command = services["router"]["command"]
    assert "--policy=cache_aware" in command
    assert {"http://kvserve-a:8000", "http://kvserve-b:8000"} <= set(command)
    gpus = [services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for n in ("kvserve-a", "kvserve-b")]
    assert gpus[0] != gpus[1]
    for name in ("kvserve-a", "kvserve-b"):
        env = services[name]["environment"]
        assert KVEventsConfig.parse(env["KVSERVE_KV_EVENTS_CONFIG"]).enable_kv_cache_events
    assert services["router"]["depends_on"] == {
        n: {"condition": "service_healthy"} for n in ("kvserve-a", "kvserve-b")}
    assert (ROOT / services["router"]["build"] / "Dockerfile").is_file()
