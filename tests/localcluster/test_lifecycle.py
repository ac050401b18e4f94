"""``up`` is idempotent, ``down`` leaves no process behind, and a cold start hands out
no pod address twice (own small clusters)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mooncake_localcluster import cluster, procs
from mooncake_localcluster.kubehttp import KubeHttp
from mooncake_localcluster.settings import LocalClusterSettings

pytestmark = pytest.mark.cluster


def test_up_twice_then_down_leaves_nothing(tmp_path: Path) -> None:
    settings = LocalClusterSettings(
        name="pytest-lifecycle", state_dir=tmp_path / "state", prefill_nodes=1, decode_nodes=1
    )
    messages: list[str] = []
    try:
        info = cluster.up(settings, messages.append)
        assert cluster.is_up(settings)
        paths = cluster.state_paths(settings)
        records = procs.records(paths.pids)
        assert {r.name for r in records} >= {
            "etcd",
            "kube-apiserver",
            "kwok",
            "pod-runner",
            "service-proxy",
        }
        pids = [pid for r in records for pid in procs.group_pids(r.pid)]

        started = time.monotonic()
        again = cluster.up(settings, messages.append)
        assert time.monotonic() - started < 5
        assert again.ports == info.ports
        assert any("already running" in m for m in messages)

        report = cluster.status(settings)
        assert report["running"] is True
        # The running cluster's network ranges are held host-wide (by its service proxy).
        resolved = cluster.read_settings(paths.root)
        claims = cluster.network_claims(resolved)
        assert info.service_cidr == resolved.service_cidr
        assert all(procs.claim(name) is None for name in claims)
    finally:
        cluster.down(settings, messages.append)
    assert not cluster.is_up(settings)
    released = [procs.claim(name) for name in claims]
    assert all(sock is not None for sock in released)
    for sock in released:
        if sock is not None:
            sock.close()
    assert procs.records(paths.pids) == []
    alive = [pid for pid in pids if not procs.is_zombie(pid)]
    assert alive == []


def _make_pods(client: KubeHttp, prefix: str, count: int) -> list[str]:
    names = [f"{prefix}-{i}" for i in range(count)]
    for name in names:
        client.post("/api/v1/namespaces/default/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "registry.example/idle:1"}]},
        })
    return names


def _addresses(client: KubeHttp, names: list[str], timeout_s: float = 60.0) -> dict[str, str]:
    """Each pod's IP once every one of them runs with one."""
    deadline = time.monotonic() + timeout_s
    while True:
        pods = client.get("/api/v1/namespaces/default/pods")["items"]
        ips = {p["metadata"]["name"]: (p.get("status") or {}).get("podIP") for p in pods
               if (p.get("status") or {}).get("phase") == "Running"}
        if all(ips.get(n) for n in names):
            return {n: str(ips[n]) for n in names}
        assert time.monotonic() < deadline, f"pods not Running with an IP: {ips}"
        time.sleep(0.5)


def test_a_cold_start_gives_no_address_twice(tmp_path: Path) -> None:
    """kwok's address pool is in memory: after down and up, pods made before and after
    the restart must still hold distinct addresses (two pods on one IP break serving)."""
    settings = LocalClusterSettings(
        name="pytest-coldstart", state_dir=tmp_path / "state", prefill_nodes=1, decode_nodes=1
    )
    try:
        info = cluster.up(settings, lambda _m: None)
        client = cluster.kube_client(cluster.state_paths(settings), info.server)
        before = _addresses(client, _make_pods(client, "before", 3))
        cluster.down(settings, lambda _m: None)
        messages: list[str] = []
        info = cluster.up(settings, messages.append)
        client = cluster.kube_client(cluster.state_paths(settings), info.server)
        after = _addresses(client, _make_pods(client, "after", 3))
        kept = _addresses(client, list(before))
        every = [*kept.values(), *after.values()]
        assert len(set(every)) == len(every), (kept, after)
        assert any("3 pod(s) gave back their addresses" in m for m in messages), messages
    finally:
        cluster.down(settings, lambda _m: None)
