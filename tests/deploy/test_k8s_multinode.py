"""deploy/k8s/multi-node/: one model over two hosts as a LeaderWorkerSet, checked
without a cluster as deploy/k8s/ is: the LeaderWorkerSet against its CRD's schema
(its pod templates, left open there, validated as Pods), the Service against the
Kubernetes API; and the pieces agree: the leader serves node 0 with the group's
size as --nnodes, each worker runs --headless with its LWS index as its node rank,
both at the same rendezvous and split, GPUs per pod = tensor-parallel-size /
nnodes, every container locked down, every KVSERVE_ variable a server flag."""
from __future__ import annotations

import copy
import shlex

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.files import ROOT
from tests.deploy.test_k8s import validate

MULTI = ROOT / "deploy" / "k8s" / "multi-node"


def docs() -> list[dict]:
    return [d for p in sorted(MULTI.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
            if d]


def lws() -> dict:
    (doc,) = [d for d in docs() if d["kind"] == "LeaderWorkerSet"]
    return doc


def templates() -> dict[str, dict]:
    t = lws()["spec"]["leaderWorkerTemplate"]
    return {"leader": t["leaderTemplate"], "worker": t["workerTemplate"]}


def as_pod(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"],
            "spec": template["spec"]}


@pytest.mark.parametrize("doc", docs(), ids=lambda d: d["kind"])
def test_manifest_validates(doc):
    validate(doc)


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_each_pod_template_validates_as_a_pod(role):
    kubernetes_validate.validate(as_pod(templates()[role]),
                                 kubernetes_validate.latest_version(), strict=True)


def test_a_mistake_is_caught():
    doc = copy.deepcopy(lws())
    doc["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)
    pod = as_pod(copy.deepcopy(templates()["worker"]))
    pod["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


def flags(role: str) -> dict[str, str | bool]:
    """The kvserve serve flags of a role's container, the shell's variables as
    written ($LWS_...)."""
    (c,) = templates()[role]["spec"]["containers"]
    assert c["command"] == ["sh", "-c"]
    words = shlex.split(c["args"][0])
    assert words[:3] == ["exec", "kvserve", "serve"]
    out, words = {}, words[3:]
    while words:
        flag = words.pop(0)
        out[flag] = words.pop(0) if words and not words[0].startswith("--") else True
    return out


def test_leader_and_workers_form_one_group():
    from kvserve.server.entrypoints.cli import build_parser

    leader, worker = flags("leader"), flags("worker")
    size = lws()["spec"]["leaderWorkerTemplate"]["size"]
    assert leader["--node-rank"] == "0" and "--headless" not in leader
    assert worker["--headless"] is True and worker["--node-rank"] == "$LWS_WORKER_INDEX"
    for f in ("--nnodes", "--master-addr", "--master-port", "--tensor-parallel-size",
              "--model"):
        assert leader[f] == worker[f], f
    assert leader["--nnodes"] == "$LWS_GROUP_SIZE"
    assert leader["--master-addr"] == "$LWS_LEADER_ADDRESS"
    per_pod = int(leader["--tensor-parallel-size"]) // size
    for t in templates().values():
        (c,) = t["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == per_pod
    (leader_c,) = templates()["leader"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in leader_c["ports"]}
    assert str(ports["rendezvous"]) == leader["--master-port"]
    # Every flag is one `kvserve serve` has (parsed with the variables filled in).
    filled = {"$LWS_GROUP_SIZE": str(size), "$LWS_WORKER_INDEX": "1",
              "$LWS_LEADER_ADDRESS": "10.0.0.1", "$MODEL": "/models/model"}
    for role in ("leader", "worker"):
        argv = ["serve"]
        for f, v in flags(role).items():
            argv += [f] if v is True else [f, filled.get(v, v)]
        build_parser().parse_args(argv)


def test_the_service_reaches_only_the_leaders():
    (svc,) = [d for d in docs() if d["kind"] == "Service"]
    labels = templates()["leader"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert not svc["spec"]["selector"].items() <= templates()["worker"]["metadata"][
        "labels"].items()
    assert lws()["spec"]["leaderWorkerTemplate"]["restartPolicy"] == \
        "RecreateGroupOnPodRestart"


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_every_container_is_locked_down_and_its_variables_are_flags(role):
    from kvserve.engine.config.settings import env_name
    from kvserve.server.entrypoints.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    known = {env_name(o) for a in serve._actions for o in a.option_strings
             if o.startswith("--")}
    spec = templates()[role]["spec"]
    pod = spec["securityContext"]
    for c in spec["containers"]:
        own = c["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {
            "type": "RuntimeDefault"}
        assert own["allowPrivilegeEscalation"] is False
        assert own["capabilities"]["drop"] == ["ALL"] and own["readOnlyRootFilesystem"]
        assert "memory" in c["resources"]["limits"]
        names = {e["name"] for e in c["env"]}
        assert {n for n in names if n.startswith("KVSERVE_")} <= known
        (key,) = [e for e in c["env"] if e["name"] == "KVSERVE_API_KEY"]
        assert "secretKeyRef" in key["valueFrom"]
