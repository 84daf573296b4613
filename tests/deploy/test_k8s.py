"""deploy/k8s/, checked without a cluster: every manifest validates strictly (unknown
fields refused) against the Kubernetes API schemas that kubernetes-validate ships,
the custom resources (ServiceMonitor, InferencePool) against their CRDs' schemas
(tests/deploy/k8s_crd_schemas.json, with their sources); and the pieces agree with
each other and with the server (probes, drain time, metric names)."""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.files import ROOT

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
            "ConfigMap", "InferencePool"} <= kinds


@pytest.mark.parametrize("kind, path", [
    ("Deployment", ("spec", "template", "spec", "containers", 0, "readinessProbe", "perodSeconds")),
    ("InferencePool", ("spec", "targetPort")),
    ("ServiceMonitor", ("spec", "endpoint")),
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


def _env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container()["env"]}


def test_a_replica_takes_a_gpu_and_is_probed_on_health():
    c = _container()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_the_drain_fits_the_grace_period():
    spec = by_kind("Deployment")["spec"]["template"]["spec"]
    pause = _container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause + float(_env()["KVSERVE_SHUTDOWN_TIMEOUT"]) < spec["terminationGracePeriodSeconds"]


def test_env_names_are_server_flags():
    from engine.settings import env_name
    from server.cli import build_parser

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
