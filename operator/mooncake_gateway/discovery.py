"""Where a model's engines are: a fixed list, or Kubernetes pods found by label selector.

An :class:`EndpointSource` pushes complete endpoint lists per role to a callback
whenever they change; the gateway applies them (new instances join, missing ones
leave routing). Tests use :class:`StaticSource` (or call the callback directly); the
operator deploys the gateway with :class:`KubernetesPodSource`, which watches pods with
the ``kubernetes`` client (in a thread) and builds endpoints from each ready pod's IP
and its port annotations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from mooncake_contract.topology import parse_labels

from .settings import Endpoint, KubernetesSource, ModelSettings, Role

log = logging.getLogger(__name__)

OnEndpoints = Callable[[Role, list[Endpoint]], None]
#: seconds between watch restarts after an API error
WATCH_BACKOFF_S = 2.0
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


def core_v1_api() -> Any:
    """A ``CoreV1Api`` from the in-cluster configuration, else the kube config
    (``KUBECONFIG`` or ``~/.kube/config``)."""
    import kubernetes

    k8s: Any = kubernetes
    try:
        k8s.config.load_incluster_config()
    except k8s.config.ConfigException:
        k8s.config.load_kube_config()
    return k8s.client.CoreV1Api()


def running_pod_host(pod: Any) -> str | None:
    """The URL host of a running pod that is not being deleted (a bracketed IPv6
    address), ``None`` for any other pod. ``pod`` is a V1Pod."""
    status, meta = pod.status, pod.metadata
    if status is None or meta is None or not status.pod_ip or status.phase != "Running":
        return None
    if meta.deletion_timestamp is not None:
        return None
    ip = status.pod_ip
    return f"[{ip}]" if ":" in ip else ip


def pod_endpoint(pod: Any, cfg: KubernetesSource) -> Endpoint | None:
    """Endpoint of a running, ready pod (``None`` otherwise). ``pod`` is a V1Pod.

    The pod's revision label becomes :attr:`Endpoint.revision` (empty without one), its
    drain annotation (``"true"``) :attr:`Endpoint.draining` and its topology annotation
    :attr:`Endpoint.topology`."""
    host = running_pod_host(pod)
    if host is None:
        return None
    status, meta = pod.status, pod.metadata
    ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
    if not ready:
        return None
    ann: dict[str, str] = dict(meta.annotations or {})
    labels: dict[str, str] = dict(getattr(meta, "labels", None) or {})

    def port(key: str, default: int | None) -> int | None:
        raw = ann.get(key)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            log.warning("pod %s: annotation %s=%r is not a port", meta.name, key, raw)
            return default

    http = port(cfg.http_port_annotation, cfg.http_port)
    kv = port(cfg.kv_events_port_annotation, cfg.kv_events_port)
    replay = port(cfg.kv_replay_port_annotation, cfg.kv_replay_port)
    pod_name = f"{meta.namespace}/{meta.name}"
    return Endpoint(
        url=f"http://{host}:{http}",
        kv_events=f"tcp://{host}:{kv}" if kv else None,
        kv_replay=f"tcp://{host}:{replay}" if replay else None,
        kv_topic=ann.get(cfg.kv_topic_annotation, ""),
        name=pod_name,
        pod=pod_name,
        revision=labels.get(cfg.revision_label, ""),
        draining=ann.get(cfg.drain_annotation, "").strip().lower() == "true",
        topology=_topology(ann.get(cfg.topology_annotation), meta.name),
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


def object_key(obj: Any) -> str:
    """``namespace/name`` of a Kubernetes object."""
    return f"{obj.metadata.namespace}/{obj.metadata.name}"


class ListWatch:
    """Objects of one kind matching a label selector, listed and then watched from the
    list's version in a thread; ``report`` gets the whole set (``namespace/name`` →
    object) after the list and after every event. An API error (server restart, expired
    version, rotated token) lists again after :data:`WATCH_BACKOFF_S`; a watch the
    server ends (``timeout_s``) lists again at once."""

    def __init__(self, list_call: Callable[..., Any], args: tuple[Any, ...], selector: str,
                 timeout_s: int, report: Callable[[dict[str, Any]], None], what: str,
                 watch_factory: Callable[[], Any] | None = None) -> None:
        self.list_call = list_call
        self.args = args
        self.selector = selector
        self.timeout_s = timeout_s
        self.report = report
        self.what = what
        self._watch_factory = watch_factory
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"k8s-watch-{self.what}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (a blocked watch is woken by closing its socket)."""
        self._stop.set()
        w = self._watch
        if w is not None:
            with contextlib.suppress(Exception):
                w.stop()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        make_watch = self._watch_factory
        if make_watch is None:
            import kubernetes.watch

            make_watch = kubernetes.watch.Watch
        while not self._stop.is_set():
            try:
                listing = self.list_call(*self.args, label_selector=self.selector)
                objects = {object_key(o): o for o in listing.items}
                self.report(dict(objects))
                w = self._watch = make_watch()
                for ev in w.stream(self.list_call, *self.args, label_selector=self.selector,
                                   resource_version=listing.metadata.resource_version,
                                   timeout_seconds=self.timeout_s):
                    if self._stop.is_set():
                        break
                    obj = ev["object"]
                    if ev["type"] == "DELETED":
                        objects.pop(object_key(obj), None)
                    elif ev["type"] in ("ADDED", "MODIFIED"):
                        objects[object_key(obj)] = obj
                    else:  # BOOKMARK and the like
                        continue
                    self.report(dict(objects))
            except Exception as exc:  # the API server restarts, tokens rotate: retry
                if self._stop.is_set():
                    break
                log.warning("%s watch (%s) failed: %s", self.what, self.selector, exc)
                self._stop.wait(WATCH_BACKOFF_S)
            finally:
                self._watch = None


class KubernetesPodSource(EndpointSource):
    """Watches the model's prefill and decode pods (list, then watch from its version)."""

    def __init__(self, cfg: KubernetesSource, api: Any | None = None,
                 watch_factory: Callable[[], Any] | None = None) -> None:
        """``api``: a ``CoreV1Api`` (default: from the in-cluster or kube config);
        ``watch_factory``: makes a ``kubernetes.watch.Watch`` (tests pass fakes)."""
        self.cfg = cfg
        self._api = api
        self._watch_factory = watch_factory
        self._watches: list[ListWatch] = []
        self._stopped = False

    async def start(self, on_change: OnEndpoints) -> None:
        loop = asyncio.get_running_loop()
        if self._api is None:
            self._api = core_v1_api()

        def deliver(role: Role, eps: list[Endpoint]) -> None:
            if not self._stopped:  # nothing reaches a model that is gone
                on_change(role, eps)

        def reporter(role: Role) -> Callable[[dict[str, Any]], None]:
            def report(pods: dict[str, Any]) -> None:
                eps = [e for p in pods.values() if (e := pod_endpoint(p, self.cfg)) is not None]
                loop.call_soon_threadsafe(deliver, role, sorted(eps, key=lambda e: e.url))
            return report

        for role, selector in ((Role.PREFILL, self.cfg.prefill_selector),
                               (Role.DECODE, self.cfg.decode_selector)):
            watch = ListWatch(self._api.list_namespaced_pod, (self.cfg.namespace,), selector,
                              self.cfg.watch_timeout_s, reporter(role), f"pods-{role.value}",
                              self._watch_factory)
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
