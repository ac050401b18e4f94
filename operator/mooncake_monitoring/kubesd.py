"""Pod discovery written to a file, labelled as Prometheus' ``kubernetes_sd`` (role pod)
labels it.

Debian's Prometheus (the one ``apt-get install prometheus`` gives, 2.42) is built without
Kubernetes discovery. With this module a thread lists the pods and writes them for
``file_sd_configs``, one target group per container port with the same
``__meta_kubernetes_*`` labels Prometheus' own discovery attaches. The scrape config's
relabelling (generated from the chart's monitors) then selects targets exactly as it would
with ``kubernetes_sd_configs``. Used by the end-to-end tests on the embedded cluster.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

JsonDict = dict[str, Any]


def _name(value: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", value)


def _pod_labels(pod: Mapping[str, Any]) -> dict[str, str]:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    out = {"__meta_kubernetes_namespace": meta.get("namespace", ""),
           "__meta_kubernetes_pod_name": meta["name"],
           "__meta_kubernetes_pod_uid": meta.get("uid", ""),
           "__meta_kubernetes_pod_ip": status.get("podIP", ""),
           "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
           "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
           "__meta_kubernetes_pod_phase": status.get("phase", ""),
           "__meta_kubernetes_pod_ready": "true" if ready else "false"}
    for key, value in (meta.get("labels") or {}).items():
        out[f"__meta_kubernetes_pod_label_{_name(key)}"] = str(value)
        out[f"__meta_kubernetes_pod_labelpresent_{_name(key)}"] = "true"
    for key, value in (meta.get("annotations") or {}).items():
        out[f"__meta_kubernetes_pod_annotation_{_name(key)}"] = str(value)
        out[f"__meta_kubernetes_pod_annotationpresent_{_name(key)}"] = "true"
    return out


def pod_target_groups(pods: Iterable[Mapping[str, Any]]) -> list[JsonDict]:
    """``file_sd`` target groups: one per container port of each pod with an IP."""
    groups: list[JsonDict] = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        base = _pod_labels(pod)
        for c in (pod.get("spec") or {}).get("containers") or []:
            for port in c.get("ports") or []:
                labels = {**base,
                          "__meta_kubernetes_pod_container_name": c["name"],
                          "__meta_kubernetes_pod_container_init": "false",
                          "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                          "__meta_kubernetes_pod_container_port_number":
                              str(port["containerPort"]),
                          "__meta_kubernetes_pod_container_port_protocol":
                              port.get("protocol", "TCP")}
                groups.append({"targets": [f"{ip}:{port['containerPort']}"],
                               "labels": labels})
    return groups


def write_targets(path: Path, pods: Iterable[Mapping[str, Any]]) -> int:
    """Write the pods' target groups to ``path`` atomically; returns how many."""
    groups = pod_target_groups(pods)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, path)
    return len(groups)
