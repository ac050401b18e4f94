"""Pod Security ``restricted``, checked without a cluster: the checker itself, every pod
the chart renders and every pod the operator generates (engines of the three kinds, the
store master and store nodes; RDMA is the one documented exception)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from mooncake_operator import builders
from mooncake_operator.names import ClusterRef
from mooncake_operator.spec import MooncakeClusterSpec

from ..operator.manifests import SETTINGS, example, with_updates
from .chartutil import ALL_ON, render
from .pss import pod_spec_of, restricted_violations

JsonDict = dict[str, Any]

GOOD: JsonDict = {
    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{"name": "c", "image": "x", "securityContext": {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
    "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "info", "downwardAPI": {}}],
}


def _with(path: str, value: Any) -> JsonDict:
    spec = copy.deepcopy(GOOD)
    node: Any = spec
    *head, last = path.split(".")
    for k in head:
        node = node[int(k)] if k.isdigit() else node.setdefault(k, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return spec


def test_checker_accepts_a_restricted_pod() -> None:
    assert restricted_violations(GOOD) == []
    # runAsNonRoot and seccomp on every container instead of the pod is fine too
    spec = _with("securityContext", {})
    spec["containers"][0]["securityContext"].update(
        runAsNonRoot=True, seccompProfile={"type": "Localhost", "localhostProfile": "p"})
    assert restricted_violations(spec) == []
    assert restricted_violations(_with("containers.0.securityContext.capabilities.add",
                                       ["NET_BIND_SERVICE"])) == []


@pytest.mark.parametrize(("path", "value", "field"), [
    ("hostNetwork", True, "spec.hostNetwork"),
    ("hostPID", True, "spec.hostPID"),
    ("hostIPC", True, "spec.hostIPC"),
    ("volumes", [{"name": "h", "hostPath": {"path": "/"}}], "hostPath"),
    ("volumes", [{"name": "n", "nfs": {"server": "s", "path": "/"}}], "volume type nfs"),
    ("securityContext.runAsNonRoot", None, "runAsNonRoot"),
    ("securityContext.runAsNonRoot", False, "spec.securityContext.runAsNonRoot"),
    ("securityContext.runAsUser", 0, "spec.securityContext.runAsUser"),
    ("securityContext.seccompProfile", {"type": "Unconfined"}, "seccompProfile"),
    ("securityContext.seccompProfile", None, "seccompProfile"),
    ("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "sysctls"),
    ("containers.0.securityContext.privileged", True, "privileged"),
    ("containers.0.securityContext.allowPrivilegeEscalation", None,
     "allowPrivilegeEscalation"),
    ("containers.0.securityContext.allowPrivilegeEscalation", True,
     "allowPrivilegeEscalation"),
    ("containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]},
     "capabilities.drop"),
    ("containers.0.securityContext.capabilities", {"drop": ["ALL"], "add": ["IPC_LOCK"]},
     "capabilities.add: IPC_LOCK"),
    ("containers.0.securityContext.runAsUser", 0, "containers[c].securityContext.runAsUser"),
    ("containers.0.securityContext.procMount", "Unmasked", "procMount"),
    ("containers.0.securityContext.seLinuxOptions", {"user": "root"}, "seLinuxOptions.user"),
    ("containers.0.ports", [{"containerPort": 80, "hostPort": 80}], "hostPort"),
    ("initContainers", [{"name": "i", "image": "x"}], "initContainers[i]"),
])
def test_checker_names_each_violation(path: str, value: Any, field: str) -> None:
    problems = restricted_violations(_with(path, value))
    assert problems, f"{path}={value!r} passed"
    assert any(field in p for p in problems), problems


# -- the chart's pod ------------------------------------------------------------------------
@pytest.mark.parametrize("values", [None, ALL_ON], ids=["default", "all-on"])
def test_chart_pods_are_restricted(values: dict[str, Any] | None) -> None:
    workloads = [o for o in render(values) if o["kind"] in ("Pod", "Deployment", "DaemonSet",
                                                               "StatefulSet", "Job")]
    assert [o["kind"] for o in workloads] == ["Deployment"]
    for w in workloads:
        spec = pod_spec_of(w)
        assert restricted_violations(spec) == []
        for ctr in spec["containers"]:
            sc = ctr["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, ctr["name"]
        assert spec["securityContext"]["runAsUser"] == 65532


# -- the operator's pods --------------------------------------------------------------------
def _spec(engine: str, **updates: Any) -> tuple[ClusterRef, MooncakeClusterSpec]:
    ref, spec = example(engine)
    return ref, with_updates(spec, **updates)


def generated(ref: ClusterRef, spec: MooncakeClusterSpec) -> list[tuple[str, JsonDict]]:
    """(what, pod spec) of every pod the operator makes for this cluster."""
    rev = builders.revision(ref, spec, SETTINGS)
    out = [(f"{role} pod", builders.engine_pod(ref, spec, SETTINGS, role, rev, 0)["spec"])
           for role in builders.POOL_ROLES]
    out += [(f"{o['kind']} {o['metadata']['name']}", pod_spec_of(o))
            for o in builders.children(ref, spec, SETTINGS)
            if o["kind"] in ("Deployment", "DaemonSet")]
    return out


CASES: list[tuple[str, dict[str, Any]]] = [
    ("simulated", {}),
    ("simulated", {"store__enabled": False}),
    ("vllm", {"store__protocol": "tcp"}),
    ("vllm", {"store__protocol": "tcp", "store__enabled": False}),
    ("sglang", {"store__protocol": "tcp"}),
]


@pytest.mark.parametrize(("engine", "updates"), CASES,
                         ids=[f"{e}-{'-'.join(f'{k}={v}' for k, v in u.items()) or 'example'}"
                              for e, u in CASES])
def test_generated_pods_are_restricted(engine: str, updates: dict[str, Any]) -> None:
    ref, spec = _spec(engine, **updates)
    pods = generated(ref, spec)
    assert len(pods) == (4 if spec.store.enabled else 2)
    for what, pod in pods:
        assert restricted_violations(pod) == [], what
        for ctr in pod["containers"]:
            assert ctr["securityContext"]["readOnlyRootFilesystem"] is True, (what, ctr["name"])
            assert {"name": "tmp", "mountPath": "/tmp"} in ctr["volumeMounts"], (what,
                                                                                 ctr["name"])
        assert pod["automountServiceAccountToken"] is False, what


@pytest.mark.parametrize("engine", ["simulated", "vllm", "sglang"])
def test_rdma_adds_only_ipc_lock_where_memory_is_registered(engine: str) -> None:
    """RDMA transfers pin memory: IPC_LOCK on real engines and store nodes, and nothing
    else leaves `restricted` (those pods are `privileged`-level). The simulated engine's
    store client always uses TCP."""
    ref, spec = _spec(engine, store__protocol="rdma")
    for what, pod in generated(ref, spec):
        problems = restricted_violations(pod)
        if what.startswith(("prefill", "decode")) and engine != "simulated":
            assert problems == ["spec.containers[engine].securityContext.capabilities.add: "
                                "IPC_LOCK not allowed"], what
        elif "store-node" in what:
            assert problems == ["spec.containers[store-node].securityContext.capabilities"
                                ".add: IPC_LOCK not allowed"], what
        else:
            assert problems == [], what


def test_service_account_override_keeps_its_token() -> None:
    ref, spec = _spec("simulated", prefill__podOverrides__serviceAccountName="engine")
    rev = builders.revision(ref, spec, SETTINGS)
    pod = builders.engine_pod(ref, spec, SETTINGS, "prefill", rev, 0)["spec"]
    assert pod["serviceAccountName"] == "engine"
    assert pod["automountServiceAccountToken"] is True


def test_real_engines_get_writable_caches() -> None:
    ref, spec = _spec("vllm", store__protocol="tcp")
    rev = builders.revision(ref, spec, SETTINGS)
    pod = builders.engine_pod(ref, spec, SETTINGS, "decode", rev, 0)["spec"]
    engine = pod["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["HOME"] in mounts and "emptyDir" in vols[mounts[env["HOME"]]]
    assert env["USER"]
