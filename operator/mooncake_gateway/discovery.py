"""Where a model's engines are: a fixed list, or Kubernetes pods found by label selector.

An :class:`EndpointSource` pushes complete endpoint lists per role to a callback
whenever they change; the gateway applies them (new instances join, missing ones
leave routing). Tests use :class:`StaticSource` (or call the callback directly); the
operator deploys the gateway with :class:`KubernetesPodSource`, which watches pods
through the project's one Kubernetes client (:mod:`mooncake_kube`, in a thread) and
builds endpoints from each ready pod's IP and its port annotations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from mooncake_contract.topology import parse_labels
from mooncake_kube.client import KubeClient, api_client_from_env
from mooncake_kube.listwatch import ListWatch

from .settings import Endpoint, KubernetesSource, ModelSettings, Role

log = logging.getLogger(__name__)

OnEndpoints = Callable[[Role, list[Endpoint]], None]
JsonDict = dict[str, Any]
#: seconds to wait for a stopped watch thread (a daemon: it ends on its own)
JOIN_WAIT_S = 0.1


class EndpointSource(ABC):
    @abstractmethod
    async def start(self, on_change: OnEndpoints) -> None:
        """Report the current endpoints, then keep reporting changes until :meth:`stop`."""

    async def stop(self) -> None:  # noqa: B027 (optional hook)
        """Stop watching."""


class StaticSource(EndpointSource):
    def __init__(self, model: ModelSettings) -> None:
        self.model = model

    async def start(self, on_change: OnEndpoints) -> None:
        on_change(Role.PREFILL, list(self.model.prefill))
        on_change(Role.DECODE, list(self.model.decode))


class FileSource(EndpointSource):
    """Endpoints from a YAML/JSON file ``{prefill: [...], decode: [...]}``, re-read when its
    modification time changes (a mounted ConfigMap, or a test)."""

    def __init__(self, path: str, poll_s: float) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._task: asyncio.Task[None] | None = None
        self._mtime: float | None = None

    def _read(self, on_change: OnEndpoints) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
            if mtime == self._mtime:
                return
            data = yaml.safe_load(self.path.read_text(encoding="utf-8")) or {}
            lists = {role: [Endpoint.model_validate(e) for e in data.get(role.value) or []]
                     for role in Role}
        except (OSError, ValueError, yaml.YAMLError, AttributeError) as exc:
            log.warning("endpoints file %s unreadable: %s", self.path, exc)
            return
        self._mtime = mtime
        for role, eps in lists.items():
            on_change(role, eps)

    async def start(self, on_change: OnEndpoints) -> None:
        self._read(on_change)

        async def poll() -> None:
            while True:
                await asyncio.sleep(self.poll_s)
                self._read(on_change)

        self._task = asyncio.get_running_loop().create_task(poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def kube_client() -> KubeClient:
    """The client from the in-cluster configuration, else the kube config
    (``KUBECONFIG`` or ``~/.kube/config``)."""
    return KubeClient(api_client_from_env())


def running_pod_host(pod: JsonDict) -> str | None:
    """The URL host of a running pod that is not being deleted (a bracketed IPv6
    address), ``None`` for any other pod."""
    status, meta = pod.get("status") or {}, pod.get("metadata") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running" or meta.get("deletionTimestamp"):
        return None
    return f"[{ip}]" if ":" in ip else str(ip)


def pod_endpoint(pod: JsonDict, cfg: KubernetesSource) -> Endpoint | None:
    """Endpoint of a running, ready pod (``None`` otherwise).

    The pod's revision label becomes :attr:`Endpoint.revision` (empty without one), its
    drain annotation (``"true"``) :attr:`Endpoint.draining` and its topology annotation
    :attr:`Endpoint.topology`."""
    host = running_pod_host(pod)
    if host is None:
        return None
    status, meta = pod.get("status") or {}, pod.get("metadata") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    if not ready:
        return None
    ann: dict[str, str] = dict(meta.get("annotations") or {})
    labels: dict[str, str] = dict(meta.get("labels") or {})
    name = str(meta.get("name", ""))

    def port(key: str, default: int | None) -> int | None:
        raw = ann.get(key)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            log.warning("pod %s: annotation %s=%r is not a port", name, key, raw)
            return default

    http = port(cfg.http_port_annotation, cfg.http_port)
    kv = port(cfg.kv_events_port_annotation, cfg.kv_events_port)
    replay = port(cfg.kv_replay_port_annotation, cfg.kv_replay_port)
    pod_name = f"{meta.get('namespace', '')}/{name}"
    return Endpoint(
        url=f"http://{host}:{http}",
        kv_events=f"tcp://{host}:{kv}" if kv else None,
        kv_replay=f"tcp://{host}:{replay}" if replay else None,
        kv_topic=ann.get(cfg.kv_topic_annotation, ""),
        name=pod_name,
        pod=pod_name,
        revision=labels.get(cfg.revision_label, ""),
        draining=ann.get(cfg.drain_annotation, "").strip().lower() == "true",
        topology=_topology(ann.get(cfg.topology_annotation), name),
    )


def _topology(value: str | None, pod: str) -> dict[str, str]:
    """The topology annotation's labels (``{}``, with a warning, when unreadable)."""
    if not value:
        return {}
    labels = parse_labels(value)
    if labels is None:
        log.warning("pod %s: topology annotation %r is not an object of strings", pod, value)
        return {}
    return labels


class KubernetesPodSource(EndpointSource):
    """Watches the model's prefill and decode pods (list, then watch from its version)."""

    def __init__(self, cfg: KubernetesSource, kube: KubeClient | None = None) -> None:
        """``kube``: the client (default: from the in-cluster or kube config)."""
        self.cfg = cfg
        self._kube = kube
        self._watches: list[ListWatch] = []
        self._stopped = False

    async def start(self, on_change: OnEndpoints) -> None:
        loop = asyncio.get_running_loop()
        if self._kube is None:
            self._kube = kube_client()
        kube = self._kube

        def deliver(role: Role, eps: list[Endpoint]) -> None:
            if not self._stopped:  # nothing reaches a model that is gone
                on_change(role, eps)

        def reporter(role: Role) -> Callable[[dict[str, JsonDict]], None]:
            def report(pods: dict[str, JsonDict]) -> None:
                eps = [e for p in pods.values() if (e := pod_endpoint(p, self.cfg)) is not None]
                loop.call_soon_threadsafe(deliver, role, sorted(eps, key=lambda e: e.url))
            return report

        for role, selector in ((Role.PREFILL, self.cfg.prefill_selector),
                               (Role.DECODE, self.cfg.decode_selector)):
            watch = ListWatch(kube, f"/api/v1/namespaces/{self.cfg.namespace}/pods", selector,
                              self.cfg.watch_timeout_s, reporter(role), f"pods-{role.value}")
            self._watches.append(watch)
            watch.start()

    async def stop(self) -> None:
        self._stopped = True
        for w in self._watches:
            w.stop()
        for w in self._watches:
            await asyncio.to_thread(w.join, JOIN_WAIT_S)


def source_for(model: ModelSettings, poll_s: float) -> EndpointSource:
    if model.endpoints_file is not None:
        return FileSource(model.endpoints_file, poll_s)
    if model.kubernetes is not None:
        return KubernetesPodSource(model.kubernetes)
    return StaticSource(model)
