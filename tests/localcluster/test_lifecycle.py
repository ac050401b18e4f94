"""``up`` is idempotent and ``down`` leaves no process behind (own small cluster)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mooncake_localcluster import cluster, procs
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
