"""Pod addresses across a cold start of the embedded cluster.

kwok hands out pod IPs from an in-memory pool per node podCIDR (``PodIPsWith`` in the
pod-ready Stage). The pool starts empty each time kwok starts, and kwok marks an existing
pod's address as taken only when it plays a Stage on that pod. Our pods that were Running
before ``local-cluster down`` match no Stage after ``up``, so kwok would hand their
addresses to new pods: two pods on one IP, and the second one's server fails with
"address in use" (seen on a second ``demo`` run).

A cold start is a node reboot: every pod process is gone. So before kwok starts, each
bound pod gives its address back, as a kubelet does when it makes a new sandbox. A pod
that was not finished goes back to ``Pending``; kwok's ready Stage then gives it a fresh
address from an empty pool, and the pod runner starts its containers there. A finished
pod keeps its phase (the API server refuses a terminal pod going back) and only drops
its address, so that kwok never recycles an address someone else now holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mooncake_localcluster.kubehttp import MERGE_PATCH, ApiError, KubeHttp

JsonDict = dict[str, Any]
TERMINAL_PHASES = ("Succeeded", "Failed")
NOT_FOUND = 404
BOUND_PODS = "/api/v1/pods?fieldSelector=spec.nodeName!%3D"
# Conditions a kubelet sets while a pod runs; PodScheduled (the scheduler's) is kept.
KUBELET_CONDITIONS = ("Initialized", "Ready", "ContainersReady", "PodReadyToStartContainers")


def reset_status(pod: JsonDict) -> JsonDict | None:
    """The status merge patch that returns ``pod``'s address, or None if it holds none."""
    status = pod.get("status") or {}
    if not status.get("podIP") and not status.get("podIPs"):
        return None
    patch: JsonDict = {"podIP": None, "podIPs": None}
    if status.get("phase") not in TERMINAL_PHASES:
        kept = [c for c in status.get("conditions") or []
                if c.get("type") not in KUBELET_CONDITIONS]
        patch.update(phase="Pending", conditions=kept, containerStatuses=None,
                     initContainerStatuses=None, startTime=None)
    return {"status": patch}


def release_pod_addresses(client: KubeHttp, log: Callable[[str], None]) -> int:
    """Give back every bound pod's address (see the module docstring). Returns how many.
    Call it while kwok is stopped."""
    released = 0
    for pod in client.get(BOUND_PODS).get("items") or []:
        patch = reset_status(pod)
        if patch is None:
            continue
        meta = pod["metadata"]
        try:
            client.patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                patch, MERGE_PATCH,
            )
        except ApiError as err:
            if err.status != NOT_FOUND:  # deleted since the list: nothing to give back
                raise
            continue
        released += 1
    if released:
        log(f"cold start: {released} pod(s) gave back their addresses; kwok assigns new ones")
    return released
