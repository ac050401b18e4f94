"""A fresh embedded cluster for a benchmark: leftover state of the same name stopped and
purged first, stopped (and purged unless kept) afterwards."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from mooncake_localcluster import cluster
from mooncake_localcluster.cluster import ClusterInfo, StatePaths
from mooncake_localcluster.settings import LocalClusterSettings


@contextlib.contextmanager
def fresh_cluster(settings: LocalClusterSettings, keep: bool,
                  log: Callable[[str], None]) -> Iterator[tuple[ClusterInfo, StatePaths]]:
    """Start the cluster ``settings`` names (``SystemExit`` naming its logs when it cannot
    start) and yield its info and paths."""
    name = settings.name
    paths = cluster.state_paths(settings)

    def quiet(message: str) -> None:
        log(f"  local-cluster: {message}")

    if paths.root.exists():
        log(f"a previous {name!r} cluster state exists; stopping and purging it first")
        cluster.down(settings, quiet)
        cluster.purge(settings, quiet)
    t0 = time.monotonic()
    try:
        info = cluster.up(settings, quiet)
    except (RuntimeError, TimeoutError, OSError) as err:
        raise SystemExit(f"could not start the local cluster {name!r}: {err}\n(logs in "
                         f"{paths.logs}; `mooncake-operator local-cluster down --name {name} "
                         "--purge` cleans up)") from None
    log(f"local cluster {name!r} up in {time.monotonic() - t0:.1f}s")
    try:
        yield info, paths
    finally:
        cluster.down(settings, quiet)
        if not keep:
            cluster.purge(settings, quiet)
        log(f"local cluster {name!r} stopped" + ("" if keep else " and purged"))
