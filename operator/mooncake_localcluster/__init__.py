"""An embedded, real Kubernetes control plane with fake GPU nodes, for tests and demos.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok are built from
pinned Go wrapper modules in ``tools/localcluster/`` and run as local processes on
127.0.0.1. A pod runner turns pods of our own images into local processes listening on
the pod IP that kwok assigned from the node's loopback ``podCIDR``.

Its surface for the other packages: ``cluster``, ``components``, ``kubehttp``, ``podspec``,
``procs``, ``services`` and ``settings``; the CLI loads ``cli`` by name. The rest is
internal (an import-linter contract holds this).
"""

from __future__ import annotations

from mooncake_localcluster.settings import LocalClusterSettings

__all__ = ["LocalClusterSettings"]
