"""The operator's login: a pod's service account at the kubelet's service address."""

from __future__ import annotations

from pathlib import Path

from mooncake_operator.handlers import in_cluster_connection


def _sa(tmp_path: Path, ca: bool = True) -> Path:
    (tmp_path / "token").write_text("tok-1\n")
    (tmp_path / "namespace").write_text("mooncake\n")
    if ca:
        (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    return tmp_path


def test_service_account_at_the_service_env_address(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "127.96.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    info = in_cluster_connection(_sa(tmp_path), env)
    assert info is not None
    assert info.server == "https://127.96.0.1:6443"
    assert info.token == "tok-1" and info.scheme == "Bearer"
    assert info.ca_path == str(tmp_path / "ca.crt")
    assert info.default_namespace == "mooncake"


def test_a_rotated_token_is_read_afresh_and_ipv6_is_bracketed(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    sa = _sa(tmp_path, ca=False)
    assert in_cluster_connection(sa, env).server == "https://[fd00::1]:443"  # type: ignore[union-attr]
    (sa / "token").write_text("tok-2")
    info = in_cluster_connection(sa, env)
    assert info is not None and info.token == "tok-2" and info.ca_path is None


def test_outside_a_pod_there_is_no_in_cluster_login(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "127.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_connection(tmp_path, env) is None  # no token mounted
    assert in_cluster_connection(_sa(tmp_path), {}) is None  # no service address
