"""A tiny kopf operator used by the local-cluster kopf smoke test."""

from __future__ import annotations

from typing import Any

import kopf


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # Reads $KUBECONFIG at call time (the kubernetes client fixes it at import time).
    return kopf.login_with_kubeconfig(**kwargs)


@kopf.on.create("configmaps", labels={"mooncake.io/kopf-smoke": "true"})
def mark(patch: Any, **_: Any) -> None:
    patch.metadata.annotations["mooncake.io/seen-by"] = "kopf"
