"""deploy/k8s/, checked without a cluster: every manifest validates strictly (unknown
fields refused) against the Kubernetes API schemas that kubernetes-validate ships,
the custom resources (ServiceMonitor, InferencePool) against their CRDs' schemas
(tests/deploy/k8s_crd_schemas.json, with their sources); and the pieces agree with
each other and with the server (probes, drain time, metric names). The pods are
locked down (non-root, no privilege escalation, no capabilities, seccomp, a read-only
root with emptyDirs where kvserve writes, a memory limit), the API key comes from a
Secret, and a NetworkPolicy admits only routers to the KV cache events, which no
Service offers."""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.files import ROOT, dockerfile_stages

K8S = ROOT / "deploy" / "k8s"
CRDS = json.loads(Path(__file__).with_name("k8s_crd_schemas.json").read_text())


def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict:
    (doc,) = [d for d in manifests() if d["kind"] == kind]
    return doc


def _strict(schema):
    """No field an object's schema does not declare (kubeconform's -strict), except
    where the CRD keeps unknown fields."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


def validate(doc: dict) -> None:
    key = f"{doc['apiVersion']}/{doc['kind']}"
    if key in CRDS:
        schema = _strict(CRDS[key])
        schema["properties"]["metadata"] = {"type": "object"}  # checked by the API server
        jsonschema.Draft7Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: d["kind"])
def test_manifest_validates(doc):
    validate(doc)


def test_every_piece_is_there():
    kinds = {d["kind"] for d in manifests()}
    assert {"Deployment", "Service", "ServiceMonitor", "HorizontalPodAutoscaler",
            "ConfigMap", "InferencePool", "NetworkPolicy"} <= kinds


@pytest.mark.parametrize("kind, path", [
    ("Deployment", ("spec", "template", "spec", "containers", 0, "readinessProbe", "perodSeconds")),
    ("InferencePool", ("spec", "targetPort")),
    ("ServiceMonitor", ("spec", "endpoint")),
    ("NetworkPolicy", ("spec", "ingress", 0, "form")),
])
def test_a_mistake_is_caught(kind, path):
    doc = copy.deepcopy(by_kind(kind))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = 5
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(doc)


def _container() -> dict:
    return by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]


def _env() -> dict[str, str | None]:
    """name -> value (None for one taken from a Secret or a field)."""
    return {e["name"]: e.get("value") for e in _container()["env"]}


def test_a_replica_takes_a_gpu_and_is_probed_on_health_and_readiness():
    c = _container()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_the_drain_fits_the_grace_period():
    spec = by_kind("Deployment")["spec"]["template"]["spec"]
    pause = _container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause + float(_env()["KVSERVE_SHUTDOWN_TIMEOUT"]) < spec["terminationGracePeriodSeconds"]


def test_env_names_are_server_flags():
    from kvserve.engine.config.settings import env_name
    from kvserve.server.entrypoints.cli import build_parser

    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())
    assert set(_env()) <= {env_name(f) for f in flags}


def test_the_autoscaler_reads_the_metric_the_adapter_serves():
    metric = by_kind("HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load(by_kind("ConfigMap")["data"]["config.yaml"])["rules"]
    assert metric in {r["name"]["as"] for r in rules}
    assert any("kvserve:num_requests_waiting" in r["seriesQuery"] for r in rules)


def test_pool_monitor_and_service_select_the_deployments_pods():
    labels = by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    for kind, selector in [("Service", ("spec", "selector")),
                           ("ServiceMonitor", ("spec", "selector", "matchLabels")),
                           ("InferencePool", ("spec", "selector", "matchLabels"))]:
        node = by_kind(kind)
        for key in selector:
            node = node[key]
        assert node.items() <= labels.items(), kind


def _pod() -> dict:
    return by_kind("Deployment")["spec"]["template"]["spec"]


def _all_containers() -> list[dict]:
    return _pod().get("initContainers", []) + _pod()["containers"]


@pytest.mark.parametrize("container", _all_containers(), ids=lambda c: c["name"])
def test_every_container_is_locked_down(container):
    """What the restricted Pod Security Standard asks, plus a read-only root and a
    memory limit. A container's own setting wins over the pod's."""
    pod = _pod().get("securityContext", {})
    own = container.get("securityContext", {})

    def effective(key):
        return own.get(key, pod.get(key))

    assert effective("runAsNonRoot") is True
    assert own.get("allowPrivilegeEscalation") is False
    assert own.get("capabilities", {}).get("drop") == ["ALL"]
    assert effective("seccompProfile") == {"type": "RuntimeDefault"}
    assert own.get("readOnlyRootFilesystem") is True
    assert "memory" in container["resources"]["limits"]
    # The image's user, so the files it owns (the cache) stay its own.
    assert str(effective("runAsUser")) == dockerfile_stages()[-1].args("USER")[-1]


def _volumes() -> dict[str, dict]:
    return {v["name"]: v for v in _pod()["volumes"]}


def test_kvserve_writes_only_to_emptydirs_seeded_from_the_image():
    """The root is read-only: the cache (models converted, Inductor's, Triton's and
    the CPU kernels' builds) and /tmp are emptyDirs, and the cache starts as the
    image's (the default model converted at build time), copied in by the init
    container, not converted again at every start."""
    cache = dockerfile_stages()[-1].env()["KVSERVE_CACHE"]
    mounts = {m["mountPath"]: m["name"] for m in _container()["volumeMounts"]}
    for path in (cache, "/tmp"):
        assert "emptyDir" in _volumes()[mounts[path]], path
    (seed,) = _pod()["initContainers"]
    assert seed["image"] == _container()["image"]
    (target,) = [m["mountPath"] for m in seed["volumeMounts"] if m["name"] == mounts[cache]]
    # -R: -a would also set the times of the emptyDir's own directory, which is
    # root's, and fail as uid 10001.
    assert seed["command"] == ["cp", "-R", f"{cache}/.", f"{target}/"]


def test_the_api_key_comes_from_a_secret_the_operator_creates():
    (key,) = [e for e in _container()["env"] if e["name"] == "KVSERVE_API_KEY"]
    assert "value" not in key
    ref = key["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"] and not ref.get("optional", False)
    # No Secret is shipped: a key in the repository would be everyone's key.
    assert "Secret" not in {d["kind"] for d in manifests()}
    for e in _container()["env"]:
        assert "KEY" not in e["name"] or "value" not in e, e["name"]


def _ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in _container()["ports"]}


def test_the_kv_events_port_is_on_no_service():
    from kvserve.engine.config.kv_events_config import KVEventsConfig

    endpoint = KVEventsConfig.parse(_env()["KVSERVE_KV_EVENTS_CONFIG"]).endpoint
    assert endpoint.endswith(f":{_ports()['kv-events']}")
    for doc in manifests():
        if doc["kind"] == "Service":
            for port in doc["spec"]["ports"]:
                assert port.get("targetPort") not in ("kv-events", _ports()["kv-events"])
                assert port["port"] != _ports()["kv-events"]


def _policy() -> dict:
    return by_kind("NetworkPolicy")


def test_a_network_policy_selects_the_kvserve_pods():
    spec = _policy()["spec"]
    labels = by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in spec["policyTypes"]


def test_the_policy_admits_only_routers_to_the_kv_events():
    """Every rule names its sources and its ports (an empty `from` or no `ports`
    admits everyone or everything); the KV events port only from the router pods,
    in this namespace; the API port from labelled clients too."""
    routers = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvserve-router"}}}
    reach: dict[str, list[dict]] = {}
    for rule in _policy()["spec"]["ingress"]:
        assert rule.get("from") and rule.get("ports"), rule
        for port in rule["ports"]:
            assert port["port"] in _ports(), port  # a port the container names
            reach.setdefault(port["port"], []).extend(rule["from"])
    assert reach["kv-events"] == [routers]
    assert routers in reach["http"] and len(reach["http"]) > 1
    for source in reach["http"]:
        assert "ipBlock" not in source and source.get("podSelector", {}).get("matchLabels")
