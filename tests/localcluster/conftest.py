"""Fixtures shared by the local cluster's tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.cluster_fixtures import LocalK8s
from tests.localcluster.test_cluster import _exists, wait_for


@pytest.fixture
def namespace(k8s_cluster: LocalK8s) -> Iterator[str]:
    """A fresh namespace, deleted afterwards."""
    http = k8s_cluster.http()
    name = f"t-{uuid.uuid4().hex[:8]}"
    http.post("/api/v1/namespaces", {"metadata": {"name": name}})
    # The ServiceAccount admission plugin needs the controller-made default SA.
    wait_for(
        "default service account",
        lambda: _exists(http, f"/api/v1/namespaces/{name}/serviceaccounts/default"),
    )
    yield name
    http.delete(f"/api/v1/namespaces/{name}")
