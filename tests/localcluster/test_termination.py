"""The pod runner ends a deleted pod as a kubelet does: containers first, then the final
zero-grace delete, retried while the API server does not answer (a fake API client)."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest
from mooncake_localcluster import cluster, podrunner
from mooncake_localcluster.kubehttp import ApiError
from mooncake_localcluster.settings import LocalClusterSettings


class DeletingClient:
    server = "https://127.0.0.1:6443"

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.deletes: list[tuple[str, dict[str, Any]]] = []

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                *_a: Any, **_k: Any) -> dict[str, Any]:
        assert method == "DELETE" and body is not None
        self.deletes.append((path, body))
        if self.failures:
            raise self.failures.pop(0)
        return {}


POD = {"metadata": {"uid": "u-1", "namespace": "ns", "name": "p",
                    "deletionTimestamp": "2026-12-06T00:00:00Z"},
       "spec": {"containers": [{"name": "main",
                                "image": "ghcr.io/example/mooncake-operator:dev"}]},
       "status": {"phase": "Running", "podIP": "127.1.1.9"}}


def _drain(runner: podrunner.PodRunner) -> None:
    """Finish the background stops and hand their events to the runner's loop."""
    runner.stopper.shutdown(wait=True)
    runner.stopper = podrunner.ThreadPoolExecutor(1)
    while True:
        try:
            resource, kind, obj = runner.events.get_nowait()
        except queue.Empty:
            return
        runner.handle(resource, kind, obj)
        runner.stopper.shutdown(wait=True)
        runner.stopper = podrunner.ThreadPoolExecutor(1)


def test_the_final_delete_names_the_uid_and_retries_until_it_lands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(podrunner, "FINAL_DELETE_TRIES", 2)
    monkeypatch.setattr(podrunner, "RETRY_DELAY_S", 0.0)
    client = DeletingClient([OSError("refused"), ApiError(503, "unavailable"),
                             OSError("refused")])
    settings = LocalClusterSettings(state_dir=tmp_path, images_dir=tmp_path / "no-images")
    runner = podrunner.PodRunner(settings, cluster.StatePaths(tmp_path), client)  # type: ignore[arg-type]
    runner.handle(podrunner.PODS, "MODIFIED", POD)
    runner.handle(podrunner.PODS, "MODIFIED", POD)  # a second event while it finalizes
    _drain(runner)
    assert len(client.deletes) == 4  # two tries, the loop starts over, two more
    path, body = client.deletes[-1]
    assert path == "/api/v1/namespaces/ns/pods/p"
    assert body["gracePeriodSeconds"] == 0 and body["preconditions"] == {"uid": "u-1"}
    assert client.failures == []


def test_a_pod_already_gone_or_replaced_is_not_deleted_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(podrunner, "RETRY_DELAY_S", 0.0)
    for refusal in (ApiError(404, "gone"), ApiError(409, "uid precondition")):
        client = DeletingClient([refusal])
        settings = LocalClusterSettings(state_dir=tmp_path, images_dir=tmp_path / "no-images")
        runner = podrunner.PodRunner(settings, cluster.StatePaths(tmp_path), client)  # type: ignore[arg-type]
        runner.handle(podrunner.PODS, "MODIFIED", POD)
        _drain(runner)
        assert len(client.deletes) == 1
