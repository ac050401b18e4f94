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
        assert {r.name for r in records} >= {"etcd", "kube-apiserver", "kwok", "pod-runner"}
        pids = [pid for r in records for pid in procs.group_pids(r.pid)]

        started = time.monotonic()
        again = cluster.up(settings, messages.append)
        assert time.monotonic() - started < 5
        assert again.ports == info.ports
        assert any("already running" in m for m in messages)

        report = cluster.status(settings)
        assert report["running"] is True
    finally:
        cluster.down(settings, messages.append)
    assert not cluster.is_up(settings)
    assert procs.records(paths.pids) == []
    alive = [pid for pid in pids if not procs.is_zombie(pid)]
    assert alive == []
