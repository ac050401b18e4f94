"""Pod credentials without a cluster: ServiceAccount token requests and refresh, projected
volume files, the managed /etc/hosts and the per-container mount namespace."""

from __future__ import annotations

import base64
import errno
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mooncake_localcluster import cluster, mountns, podrunner, podspec, services, tokens
from mooncake_localcluster.kubehttp import ApiError
from mooncake_localcluster.settings import LocalClusterSettings

from tests.needs import missing

SA_DIR = mountns.SERVICE_ACCOUNT_DIR
# What the ServiceAccount admission plugin adds to a pod (k8s 1.36).
VOLUME = "kube-api-access-x1"
KUBE_API_ACCESS: dict[str, Any] = {
    "name": VOLUME,
    "projected": {
        "defaultMode": 420,
        "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt",
                                                                  "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
        ],
    },
}


def _pod(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "op-0", "namespace": "mooncake", "uid": "1234-abcd"},
        "spec": {"containers": [{"name": "main", "image": "x"}], **spec},
        "status": {"podIP": "127.1.1.7"},
    }


# ----- tokens ---------------------------------------------------------------------------
def test_token_request_is_the_kubelets() -> None:
    pod = _pod(serviceAccountName="mooncake-operator")
    assert tokens.request_path(pod) == (
        "/api/v1/namespaces/mooncake/serviceaccounts/mooncake-operator/token"
    )
    source = KUBE_API_ACCESS["projected"]["sources"][0]["serviceAccountToken"]
    body = tokens.token_request(pod, source)
    # No audience: the API server's own (its issuer), as the kubelet leaves it.
    assert body["spec"] == {
        "expirationSeconds": 3607,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "op-0",
                           "uid": "1234-abcd"},
    }
    custom = tokens.token_request(_pod(), {"audience": "vault", "path": "t"})
    assert custom["spec"]["audiences"] == ["vault"]
    assert custom["spec"]["expirationSeconds"] == tokens.DEFAULT_EXPIRATION_S
    assert tokens.service_account(_pod()) == "default"


def test_token_refreshes_at_80_percent_or_after_a_day() -> None:
    response = {
        "spec": {"expirationSeconds": 3607},
        "status": {"token": "t0k", "expirationTimestamp": "2026-01-01T01:00:07Z"},
    }
    token = tokens.token_from_response(response)
    issued = tokens.parse_rfc3339("2026-01-01T00:00:00Z")
    assert token.token == "t0k" and token.issued_at == issued
    assert token.refresh_at() == pytest.approx(issued + 0.8 * 3607)
    assert not token.refresh_due(issued + 2885)
    assert token.refresh_due(issued + 2886)
    week = tokens.Token("t", issued, issued + 7 * 86400)
    assert week.refresh_at() == issued + 86400
    with pytest.raises(ValueError):
        tokens.token_from_response({"status": {"expirationTimestamp": "2026-01-01T00:00:00Z"}})


# ----- projected volume files, hosts --------------------------------------------------------
def test_projected_volume_files_like_the_kubelet() -> None:
    objects = {("configmaps", "kube-root-ca.crt"): {"data": {"ca.crt": "PEM", "other": "x"}}}
    files = podspec.projected_files(_pod(), KUBE_API_ACCESS, objects, {0: "t0k"})
    assert files == {"token": b"t0k", "ca.crt": b"PEM", "namespace": b"mooncake"}
    assert podspec.projected_refs(KUBE_API_ACCESS) == [("configmaps", "kube-root-ca.crt")]
    secret = {"projected": {"sources": [{"secret": {"name": "s"}}]}}
    data = {"data": {"k": base64.b64encode(b"\x00v").decode()}}
    assert podspec.projected_files(_pod(), secret, {("secrets", "s"): data}, {}) == {
        "k": b"\x00v"
    }
    # A missing ConfigMap or a token not (yet) there writes nothing for that source.
    assert podspec.projected_files(_pod(), KUBE_API_ACCESS, {}, {}) == {
        "namespace": b"mooncake"
    }


def test_hosts_file_names_the_pod_and_every_service() -> None:
    svcs = [
        {"metadata": {"name": "kubernetes", "namespace": "default"},
         "spec": {"clusterIP": "127.96.0.1"}},
        {"metadata": {"name": "gateway", "namespace": "mooncake"},
         "spec": {"clusterIP": "127.96.0.9"}},
        {"metadata": {"name": "headless", "namespace": "mooncake"},
         "spec": {"clusterIP": "None"}},
    ]
    pod = _pod(hostAliases=[{"ip": "127.0.0.5", "hostnames": ["a", "b"]}])
    text = services.hosts_file(pod, svcs)
    lines = text.splitlines()
    assert lines[0] == "# Kubernetes-managed hosts file."
    assert "127.0.0.1\tlocalhost" in lines
    assert "127.1.1.7\top-0" in lines
    assert "127.0.0.5\ta\tb" in lines
    assert ("127.96.0.1\tkubernetes.default.svc.cluster.local\tkubernetes.default.svc"
            "\tkubernetes.default") in lines
    # Same namespace: the short name too.
    assert lines[-1].endswith("\tgateway.mooncake\tgateway")
    assert "headless" not in text
    assert services.pod_hostname(_pod()) == "op-0"
    long_name = _pod()
    long_name["metadata"]["name"] = "a" * 62 + "-b"
    assert services.pod_hostname(long_name) == "a" * 62
    sub = services.hosts_file(_pod(hostname="h", subdomain="s"), [])
    assert "127.1.1.7\th.s.mooncake.svc.cluster.local\th" in sub.splitlines()


# ----- the pod runner's token manager and mount failures (a fake API client) ------------------
class FakeClient:
    server = "https://127.0.0.1:6443"

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, Any]]] = []
        self.fail = False
        self.count = 0

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.posts.append((path, body))
        if self.fail:
            raise ApiError(403, "forbidden")
        self.count += 1
        return {
            "spec": {"expirationSeconds": body["spec"]["expirationSeconds"]},
            "status": {"token": f"token-{self.count}",
                       "expirationTimestamp": "2099-01-01T00:00:00Z"},
        }

    def get(self, path: str) -> dict[str, Any]:
        if path.endswith("/configmaps/kube-root-ca.crt"):
            return {"data": {"ca.crt": "PEM"}}
        raise ApiError(404, "not found")


def _runner(tmp_path: Path) -> tuple[podrunner.PodRunner, FakeClient]:
    # A range no cluster serves: the kubernetes Service's port 443 answers nothing.
    settings = LocalClusterSettings(state_dir=tmp_path, service_cidr="127.111.0.0/16",
                                    images_dir=tmp_path / "no-images")
    client = FakeClient()
    runner = podrunner.PodRunner(settings, cluster.StatePaths(tmp_path), client)  # type: ignore[arg-type]
    return runner, client


def _running(runner: podrunner.PodRunner, pod: dict[str, Any], tmp_path: Path
             ) -> podrunner.RunningPod:
    return podrunner.RunningPod(
        uid=pod["metadata"]["uid"], namespace="mooncake", name="op-0", pod_ip="127.1.1.7",
        directory=tmp_path / "pod",
        containers=[podrunner.ContainerProc(name="main", image="x", container=c)
                    for c in pod["spec"]["containers"]],
        restart_policy="Never", volumes=pod["spec"]["volumes"], pod=pod,
    )


def test_runner_refreshes_a_due_token_and_keeps_the_old_one_on_failure(tmp_path: Path) -> None:
    runner, client = _runner(tmp_path)
    pod = _pod(volumes=[KUBE_API_ACCESS])
    running = _running(runner, pod, tmp_path)
    runner._materialize(pod, running, only_downward=False)
    vdir = tmp_path / "pod" / "volumes" / VOLUME
    assert (vdir / "token").read_text() == "token-1"
    assert (vdir / "ca.crt").read_text() == "PEM"
    assert (vdir / "namespace").read_text() == "mooncake"
    path, body = client.posts[0]
    assert path.endswith("/serviceaccounts/default/token")
    assert body["spec"]["boundObjectRef"]["uid"] == "1234-abcd"

    runner._refresh_tokens(running)  # not due: nothing asked
    assert len(client.posts) == 1
    key = (VOLUME, 0)
    old = running.issued_tokens[key]
    running.issued_tokens[key] = tokens.Token(old.token, 0.0, 3607.0)  # issued in 1970
    client.fail = True
    runner._refresh_tokens(running)
    assert (vdir / "token").read_text() == "token-1"  # still valid until it expires
    assert running.token_retry_at > 0 and VOLUME in running.mount_errors
    running.token_retry_at = 0.0
    client.fail = False
    runner._refresh_tokens(running)
    assert (vdir / "token").read_text() == "token-2"
    assert not running.mount_errors


def test_a_late_root_ca_configmap_fills_the_token_volume(tmp_path: Path) -> None:
    runner, client = _runner(tmp_path)
    client.get = lambda path: (_ for _ in ()).throw(ApiError(404, "not yet"))  # type: ignore[method-assign]
    pod = _pod(volumes=[KUBE_API_ACCESS])
    running = _running(runner, pod, tmp_path)
    runner._materialize(pod, running, only_downward=False)
    vdir = tmp_path / "pod" / "volumes" / VOLUME
    assert not (vdir / "ca.crt").exists() and (vdir / "token").read_text() == "token-1"
    runner.pods[running.uid] = running
    runner.volume_users[("configmaps", "mooncake", "kube-root-ca.crt")] = {running.uid}
    cm = {"metadata": {"name": "kube-root-ca.crt", "namespace": "mooncake"},
          "data": {"ca.crt": "LATE"}}
    runner.handle("configmaps", "ADDED", cm)
    assert (vdir / "ca.crt").read_text() == "LATE"
    assert (vdir / "token").read_text() == "token-1"  # the same token: not asked again
    assert len(client.posts) == 1


def test_without_a_mount_namespace_a_token_pod_fails_clearly(tmp_path: Path) -> None:
    runner, client = _runner(tmp_path)
    runner._mount_ns_checked = True
    runner._mount_ns_error = "unshare: unshare failed: Operation not permitted"
    container = {"name": "main", "image": "x", "command": ["true"],
                 "volumeMounts": [{"name": VOLUME, "mountPath": SA_DIR,
                                   "readOnly": True}]}
    pod = _pod(volumes=[KUBE_API_ACCESS], containers=[container])
    running = _running(runner, pod, tmp_path)
    runner._materialize(pod, running, only_downward=False)
    cp = running.containers[0]
    runner._start_container(running, pod, cp)
    assert cp.proc is None and cp.exit_code == podrunner.NO_COMMAND_EXIT
    assert f"cannot mount {SA_DIR}: no mount namespace" in cp.message
    assert "Operation not permitted" in runner._terminated(cp)["message"]

    # A failed token request keeps the container from starting, with the reason.
    client.fail = True
    running2 = _running(runner, pod, tmp_path)
    runner._materialize(pod, running2, only_downward=False)
    runner._start_container(running2, pod, running2.containers[0])
    assert "MountVolume.SetUp failed" in running2.containers[0].message


def test_pods_get_the_apiserver_address_when_443_is_not_served(tmp_path: Path) -> None:
    runner, _ = _runner(tmp_path)
    runner.services = {("default", "kubernetes"): {
        "metadata": {"name": "kubernetes", "namespace": "default"},
        "spec": {"clusterIP": "127.111.0.1", "ports": [{"name": "https", "port": 443}]},
    }}
    env = runner.service_env(_pod())
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == "6443"
    assert env["KUBERNETES_PORT"] == "tcp://127.0.0.1:6443"
    assert env["KUBERNETES_SERVICE_PORT_HTTPS"] == "6443"


def test_bind_mounts_are_the_secrets_paths() -> None:
    assert podrunner.is_bind_mount(SA_DIR)
    assert podrunner.is_bind_mount("/var/run/secrets/eks.amazonaws.com/serviceaccount/")
    assert not podrunner.is_bind_mount("/var/run/secretsx")
    assert not podrunner.is_bind_mount("/etc/mooncake")


def test_admission_plugins_stay_on(tmp_path: Path) -> None:
    settings = LocalClusterSettings(state_dir=tmp_path)
    paths = cluster.StatePaths(tmp_path)
    argv = cluster._argv("kube-apiserver", Path("kube-apiserver"), settings, paths,
                         dict.fromkeys(cluster.PORT_NAMES, 1))
    assert not any(a.startswith("--disable-admission-plugins") for a in argv)
    enabled = [a for a in argv if a.startswith("--enable-admission-plugins=")]
    assert enabled and {"ServiceAccount", "PodSecurity"} <= set(enabled[0].split("=")[1].split(","))


# ----- the mount namespace helper ------------------------------------------------------
def test_mountns_command_and_arguments() -> None:
    binds = [("/s/sa", SA_DIR, True), ("/s/hosts", "/etc/hosts", False)]
    root = mountns.command(binds, "/s/stage", ["app", "--x"], python="py", as_root=True,
                           hostname="op-0")
    assert root[1:5] == ["--mount", "--propagation", "private", "--uts"]
    assert "--map-root-user" not in root
    user = mountns.command(binds, "/s/stage", ["app"], python="py", as_root=False)
    assert user[4:6] == ["--user", "--map-root-user"] and "--uts" not in user
    script_args = root[root.index(os.path.abspath(mountns.__file__)) + 1 :]
    assert mountns.parse(script_args) == mountns.Args("/s/stage", binds, ["app", "--x"], "op-0")
    with pytest.raises(mountns.MountError):
        mountns.parse(["--bind", "a"])


def _mount_ns_works() -> bool:
    argv = mountns.command([], "/nonexistent", ["true"])
    return subprocess.run(argv, capture_output=True, check=False, timeout=30).returncode == 0


def test_mountns_shows_the_files_at_the_fixed_path_only_inside(tmp_path: Path) -> None:
    if not _mount_ns_works():
        missing("mountns", "no mount namespaces here: unshare --mount is not permitted")
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("inside")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.9 kubernetes.default.svc\n127.1.1.7 op-0\n")
    before = os.path.exists(SA_DIR)
    outside = set(os.listdir("/var/run"))
    script = (
        "import os, socket\n"
        f"print(open('{SA_DIR}/token').read())\n"
        "print(socket.gethostbyname('kubernetes.default.svc'))\n"
        "try:\n"
        f"    open('{SA_DIR}/x', 'w')\n"
        "except OSError as err:\n"
        "    print(err.errno)\n"
        "print(' '.join(os.listdir('/var/run')))\n"
        "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))\n"
    )
    binds = [(str(sa), SA_DIR, True), (str(hosts), "/etc/hosts", False)]
    argv = mountns.command(binds, str(tmp_path / "stage"), [sys.executable, "-c", script],
                           hostname="op-0")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "inside"
    assert lines[1] == "127.0.0.9"
    assert lines[2] == str(errno.EROFS)  # mounted read-only, like the kubelet's
    # /var/run still shows what it held, plus secrets/ when that was missing.
    assert set(lines[3].split()) == outside | {"secrets"}
    assert lines[4] == "op-0 127.1.1.7"  # the pod's hostname, resolving to its IP
    assert socket.gethostname() != "op-0"
    assert os.path.exists(SA_DIR) == before  # the host never saw it


def test_mountns_reports_a_failed_mount(tmp_path: Path) -> None:
    if not _mount_ns_works():
        missing("mountns", "no mount namespaces here: unshare --mount is not permitted")
    argv = mountns.command([(str(tmp_path / "missing"), "/etc/hosts", False)],
                           str(tmp_path / "stage"), ["true"])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == mountns.MOUNT_FAILED_EXIT
    assert out.stderr.startswith(mountns.ERROR_PREFIX)
    log = tmp_path / "main.log"
    log.write_text("app output\n" + out.stderr)
    assert podrunner.mount_error_message(log).startswith(mountns.ERROR_PREFIX)
