"""Session fixture ``k8s_cluster``: the embedded control plane with fake GPU nodes.

Registered from ``tests/conftest.py`` via ``pytest_plugins``. It starts the cluster
(its own state dir under pytest's tmp dir) once per session — building the Go binaries first
if they are not cached, which takes long; CI runs ``mooncake-operator local-cluster
build`` beforehand — and stops every process at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mooncake_localcluster import bindpin, cluster, components
from mooncake_localcluster.kubehttp import KubeHttp
from mooncake_localcluster.settings import LocalClusterSettings

TEST_CLUSTER_NAME = "pytest"


@dataclass
class LocalK8s:
    settings: LocalClusterSettings
    info: cluster.ClusterInfo

    @property
    def kubeconfig(self) -> Path:
        return Path(self.info.kubeconfig)

    @property
    def state_dir(self) -> Path:
        return Path(self.info.state_dir)

    def api_client(self) -> Any:
        """A fresh ``kubernetes.client.ApiClient`` for this cluster."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]

    def http(self) -> KubeHttp:
        """The package's small JSON client (client-cert auth)."""
        return cluster.kube_client(cluster.StatePaths(self.state_dir), self.info.server)

    def binary(self, component: str) -> Path | None:
        """A cached binary of this repo's pinned components (e.g. ``helm``), if built."""
        tools = components.find_tools_dir(self.settings)
        path = components.binary_path(self.settings, components.component(component), tools)
        return path if path.is_file() else None

    def env(self) -> dict[str, str]:
        """Environment for subprocesses (kubectl, helm) pointing at this cluster."""
        return dict(os.environ, KUBECONFIG=str(self.kubeconfig))


def _binaries_missing(settings: LocalClusterSettings) -> list[str]:
    tools = components.find_tools_dir(settings)
    out = [
        name
        for name in components.RUNTIME_COMPONENTS
        if not components.binary_path(settings, components.component(name), tools).is_file()
    ]
    if bindpin.built(settings) is None:
        out.append("bindpin")  # built with the runtime set (bindpin.py)
    return out


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build missing binaries before any test runs, outside the per-test timeout."""
    if not any(item.get_closest_marker("cluster") for item in session.items):
        return
    settings = LocalClusterSettings(name=TEST_CLUSTER_NAME)
    if _binaries_missing(settings):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")

        def log(message: str) -> None:
            if reporter is not None:
                reporter.write_line(message)

        log("local-cluster binaries missing: building them now (long; see docs/local-cluster.md)")
        try:
            components.build_all(settings, components.RUNTIME_COMPONENTS, log)
        except (OSError, RuntimeError) as err:
            # The cluster tests then fail in the fixture with the same cause.
            log(f"local-cluster build failed: {err}")


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalK8s]:
    # Own state dir per session: fresh etcd, no leftovers, no clash with other sessions.
    settings = LocalClusterSettings(
        name=f"{TEST_CLUSTER_NAME}-{os.getpid()}",
        state_dir=tmp_path_factory.mktemp("localcluster"),
    )
    info = cluster.up(settings)
    try:
        # The settings `up` used: network slot and ranges resolved.
        yield LocalK8s(settings=cluster.read_settings(Path(info.state_dir)), info=info)
    finally:
        cluster.down(settings)
