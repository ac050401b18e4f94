"""A generated pod's engine container, staged on this machine as the kubelet would start it.

The kubelet's part comes from the embedded control plane's pod runner
(:mod:`mooncake_localcluster.podspec`): environment in order with ``valueFrom`` resolved,
``$(VAR)`` expansion of the environment and the arguments, the Services' variables, and
every volume mount moved to a local folder (ConfigMap volumes get their files). What the
probe is handed is then exactly what the engine process in the pod would see.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_localcluster.podspec import MountRewrite, process_spec
from mooncake_localcluster.services import service_env

JsonDict = dict[str, Any]
#: the address pods and Services get here: loopback, like the embedded cluster's
POD_IP = "127.1.0.7"
SERVICE_IP = "127.96.0.10"


@dataclass(frozen=True, slots=True)
class Staged:
    """What the engine container runs: its command, its arguments and environment."""

    command: list[str]
    args: list[str]
    env: dict[str, str]
    mounts: dict[str, Path]

    def probe_pod(self) -> JsonDict:
        return {"args": self.args, "env": self.env}


#: the entrypoint of our worker image (the CLI): its containers name only arguments
WORKER_ENTRYPOINT = ["mooncake-operator"]


def stage(pod: JsonDict, children: list[JsonDict], root: Path, container: str = "engine",
          pod_ip: str = POD_IP) -> Staged:
    """Stage ``container`` of ``pod`` under ``root`` (its mounts become folders there; two
    containers staged under one root share the folders of the volumes they share)."""
    pod = copy.deepcopy(pod)
    pod.setdefault("status", {})["podIP"] = pod_ip
    c = next(x for x in pod["spec"]["containers"] if x["name"] == container)
    services = []
    for obj in children:
        if obj["kind"] == "Service":
            svc = copy.deepcopy(obj)
            svc["spec"]["clusterIP"] = SERVICE_IP
            services.append(svc)
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in children
                  if o["kind"] == "ConfigMap"}
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    rewrites: list[MountRewrite] = []
    mounts: dict[str, Path] = {}
    for m in c.get("volumeMounts", []):
        local = root / m["name"]
        local.mkdir(parents=True, exist_ok=True)
        source = volumes[m["name"]]
        if "configMap" in source:
            for key, text in configmaps[source["configMap"]["name"]].items():
                (local / key).write_text(text)
        rewrites.append(MountRewrite(m["mountPath"], str(local)))
        mounts[m["mountPath"]] = local
    implicit = service_env(services) if pod["spec"].get("enableServiceLinks", True) else {}
    entrypoint = None if c.get("command") else WORKER_ENTRYPOINT
    spec = process_spec(pod, c, implicit, rewrites, configmaps, entrypoint)
    n = len(c.get("command") or WORKER_ENTRYPOINT)
    return Staged(command=spec.argv[:n], args=spec.argv[n:], env=spec.env, mounts=mounts)
