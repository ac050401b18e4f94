"""The API server, not the pod runner, decides what a pod may do: pod processes get their
ServiceAccount's token (never the admin kubeconfig), RBAC applies to it, and Pod
Security admission refuses pods that break a namespace's level."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import pytest
from mooncake_localcluster import cluster
from mooncake_localcluster.cluster import KUBERNETES_SERVICE_PORT
from mooncake_localcluster.kubehttp import ApiError, KubeHttp

from tests.cluster_fixtures import LocalK8s
from tests.localcluster.test_cluster import _runnable_pod, wait_for

pytestmark = pytest.mark.cluster

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted"}


@pytest.fixture
def ns(namespace: str) -> str:
    """The shared fresh-namespace fixture (tests/localcluster/conftest.py)."""
    return namespace


def _log(k8s_cluster: LocalK8s, ns: str, pod: str) -> str:
    files = list(k8s_cluster.state_dir.glob(f"pods/{ns}_{pod}_*/main.log"))
    return files[0].read_text() if files else ""


def _lines(text: str) -> dict[str, str]:
    """``key value`` lines as a dict."""
    out = {}
    for line in text.strip().splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    return out


def _finished(http: KubeHttp, path: str) -> str | None:
    phase = str(http.get(path)["status"].get("phase"))
    return phase if phase in ("Succeeded", "Failed") else None


# Runs inside the pod: in-cluster config exactly as an operator would use it.
RBAC_PROBE = f"""
import json, os, ssl, time, urllib.request
from kubernetes import client, config
SA = {SA_DIR!r}
print("files", " ".join(sorted(f for f in os.listdir(SA) if not f.startswith(".."))))
print("namespace", open(SA + "/namespace").read())
print("kubeconfig", "KUBECONFIG" in os.environ)
config.load_incluster_config()
api = client.CoreV1Api()
ns = os.environ["POD_NAMESPACE"]
def status(call):
    try:
        call()
        return 200
    except client.ApiException as err:
        return err.status
print("secrets", status(lambda: api.list_namespaced_secret(ns)))
print("pods-before", status(lambda: api.list_namespaced_pod(ns)), flush=True)
deadline = time.monotonic() + 60
while (code := status(lambda: api.list_namespaced_pod(ns))) != 200:
    if time.monotonic() > deadline:
        break
    time.sleep(0.5)
print("pods-after", code)
print("secrets-after", status(lambda: api.list_namespaced_secret(ns)))
# Who the API server thinks we are, over https://kubernetes.default.svc (the managed
# /etc/hosts, the service proxy on :443 and the CA from the token volume) when it is served.
env = os.environ
base = "https://kubernetes.default.svc" if env["KUBERNETES_SERVICE_PORT"] == "443" else (
    f"https://{{env['KUBERNETES_SERVICE_HOST']}}:{{env['KUBERNETES_SERVICE_PORT']}}")
ctx = ssl.create_default_context(cafile=SA + "/ca.crt")
opener = urllib.request.build_opener(urllib.request.ProxyHandler({{}}),
                                     urllib.request.HTTPSHandler(context=ctx))
body = json.dumps({{"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}})
req = urllib.request.Request(
    base + "/apis/authentication.k8s.io/v1/selfsubjectreviews", data=body.encode(),
    headers={{"Authorization": "Bearer " + open(SA + "/token").read(),
             "Content-Type": "application/json"}})
print("user", json.load(opener.open(req, timeout=10))["status"]["userInfo"]["username"])
print("via", base)
"""


def test_pod_token_is_its_service_accounts_and_rbac_applies(
    k8s_cluster: LocalK8s, ns: str
) -> None:
    http = k8s_cluster.http()
    host_had_sa_dir = os.path.exists(SA_DIR)
    pod = _runnable_pod("rbac", ["python", "-c", RBAC_PROBE], restartPolicy="Never")
    http.post(f"/api/v1/namespaces/{ns}/pods", pod)
    wait_for("the pod's first tries", lambda: "pods-before" in _log(k8s_cluster, ns, "rbac"))
    early = _lines(_log(k8s_cluster, ns, "rbac"))
    assert early["files"] == "ca.crt namespace token"
    assert early["namespace"] == ns
    assert early["kubeconfig"] == "False"
    assert early["secrets"] == "403" and early["pods-before"] == "403"
    # The admin can read what the pod's token cannot.
    assert http.get(f"/api/v1/namespaces/{ns}/secrets")["kind"] == "SecretList"

    rbac = "/apis/rbac.authorization.k8s.io/v1/namespaces/" + ns
    http.post(f"{rbac}/roles", {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
    })
    http.post(f"{rbac}/rolebindings", {
        "metadata": {"name": "pod-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}],
    })
    path = f"/api/v1/namespaces/{ns}/pods/rbac"
    phase = wait_for("the pod finished", lambda: _finished(http, path), timeout_s=90)
    out = _log(k8s_cluster, ns, "rbac")
    assert phase == "Succeeded", out
    lines = _lines(out)
    assert lines["pods-after"] == "200"  # the same token, now with the RoleBinding
    assert lines["secrets-after"] == "403"
    assert lines["user"] == f"system:serviceaccount:{ns}:default"
    if cluster.can_bind_port(KUBERNETES_SERVICE_PORT):
        assert lines["via"] == "https://kubernetes.default.svc"
    assert os.path.exists(SA_DIR) == host_had_sa_dir  # mounted in the pod's namespace only


def test_automount_false_means_no_token(k8s_cluster: LocalK8s, ns: str) -> None:
    http = k8s_cluster.http()
    http.post(f"/api/v1/namespaces/{ns}/serviceaccounts", {
        "metadata": {"name": "quiet"}, "automountServiceAccountToken": False,
    })
    check = ["python", "-c", f"import os; print(os.path.exists({SA_DIR!r}))"]
    by_pod = _runnable_pod("by-pod", check, restartPolicy="Never",
                           automountServiceAccountToken=False)
    by_sa = _runnable_pod("by-sa", check, restartPolicy="Never", serviceAccountName="quiet")
    for pod in (by_pod, by_sa):
        created = http.post(f"/api/v1/namespaces/{ns}/pods", pod)
        assert not any("projected" in v for v in created["spec"].get("volumes") or [])
    for name in ("by-pod", "by-sa"):
        path = f"/api/v1/namespaces/{ns}/pods/{name}"
        assert wait_for(f"{name} finished", functools.partial(_finished, http, path)) == (
            "Succeeded"
        )
        assert _log(k8s_cluster, ns, name).strip() == "False"


def _compliant(name: str) -> dict[str, Any]:
    return _runnable_pod(
        name,
        ["python", "-c", "print('admitted')"],
        restartPolicy="Never",
        securityContext={"runAsNonRoot": True, "runAsUser": 65532,
                         "seccompProfile": {"type": "RuntimeDefault"}},
        container={"securityContext": {"allowPrivilegeEscalation": False,
                                       "capabilities": {"drop": ["ALL"]}}},
    )


def test_restricted_namespace_refuses_a_privileged_pod(k8s_cluster: LocalK8s, ns: str) -> None:
    http = k8s_cluster.http()
    http.patch(f"/api/v1/namespaces/{ns}", {"metadata": {"labels": RESTRICTED}})
    privileged = _compliant("privileged")
    # (allowPrivilegeEscalation: false is invalid next to privileged: true)
    privileged["spec"]["containers"][0]["securityContext"] = {
        "privileged": True, "capabilities": {"drop": ["ALL"]}
    }
    with pytest.raises(ApiError) as refused:
        http.post(f"/api/v1/namespaces/{ns}/pods", privileged)
    assert refused.value.status == 403
    message = json.loads(refused.value.body)["message"]
    assert 'violates PodSecurity "restricted:latest"' in message
    assert 'privileged (container "main" must not set securityContext.privileged=true)' in message
    # The same pod without the flag is admitted (and runs).
    http.post(f"/api/v1/namespaces/{ns}/pods", _compliant("compliant"))
    path = f"/api/v1/namespaces/{ns}/pods/compliant"
    assert wait_for("compliant pod finished", lambda: _finished(http, path)) == "Succeeded"
    assert _log(k8s_cluster, ns, "compliant").strip() == "admitted"
