"""Models described by ConfigMaps: which model each serves, which are bad, which conflict.

The operator writes one ConfigMap per ``MooncakeCluster`` ("the gateway's view of this
cluster"), labelled ``mooncake.io/gateway-model: "true"``, whose ``model.yaml`` key is a
:class:`~mooncake_gateway.settings.ModelSettings` document. The gateway lists and watches
them (:class:`ConfigMapWatch`, a list-watch of the project's one client) and
resolves the set it sees with :func:`resolve`, a pure function:

- a document that is not YAML, not a mapping, or not valid settings is *invalid*: its
  ConfigMap serves nothing and is reported with the error;
- a ``kubernetes:`` pod source without a ``namespace`` looks in the ConfigMap's own;
- two ConfigMaps naming the same model: the older (creation time, then
  ``namespace/name``) serves it, the other is reported as a *conflict*; a model the
  gateway's own settings define is never taken over by a ConfigMap.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml
from mooncake_kube.client import KubeClient
from mooncake_kube.listwatch import ListWatch, object_key
from pydantic import ValidationError

from .discovery import JOIN_WAIT_S, kube_client
from .settings import KubernetesModels, ModelSettings

#: the source name of models from the gateway's own settings in conflict reports
SETTINGS_SOURCE = "settings"
#: longest error message kept per invalid document
ERROR_CHARS = 2000


@dataclass(frozen=True, slots=True)
class ModelDocument:
    """One ConfigMap's model document, as read (nothing parsed yet)."""

    source: str  # namespace/name of the ConfigMap
    namespace: str
    created: float  # creation time, seconds since the epoch (older wins a model name)
    text: str | None  # the document; None when the ConfigMap lacks the key
    version: str = ""  # resourceVersion


@dataclass(frozen=True, slots=True)
class Conflict:
    source: str
    model: str
    winner: str


@dataclass(slots=True)
class Catalog:
    """What to serve: model name → (source, settings); plus what was left out and why."""

    served: dict[str, tuple[str, ModelSettings]] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)  # source → error
    conflicts: list[Conflict] = field(default_factory=list)


def configmap_document(cm: dict[str, Any], key: str) -> ModelDocument:
    """A ConfigMap, as the API answers it, as a :class:`ModelDocument`."""
    meta = cm.get("metadata") or {}
    created = meta.get("creationTimestamp")
    stamp = 0.0  # unknown: counts as oldest, the name decides among such
    if isinstance(created, str):  # RFC 3339
        with contextlib.suppress(ValueError):
            stamp = dt.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    data = cm.get("data") or {}
    return ModelDocument(source=object_key(cm), namespace=str(meta.get("namespace", "")),
                         created=stamp, text=data.get(key),
                         version=str(meta.get("resourceVersion") or ""))


def parse_document(doc: ModelDocument, key: str) -> ModelSettings:
    """The document's settings; ``ValueError`` with a readable reason when invalid."""
    if doc.text is None:
        raise ValueError(f"no {key!r} key")
    try:
        data = yaml.safe_load(doc.text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("the document is not a mapping")
    kube = data.get("kubernetes")
    if isinstance(kube, dict) and "namespace" not in kube:
        data = {**data, "kubernetes": {**kube, "namespace": doc.namespace}}
    try:
        return ModelSettings.model_validate(data)
    except ValidationError as exc:
        raise ValueError(str(exc)[:ERROR_CHARS]) from None


def resolve(docs: Iterable[ModelDocument], key: str,
            reserved: Iterable[str] = ()) -> Catalog:
    """Which ConfigMap serves which model (see the module's rules); ``reserved``: model
    names the gateway's own settings serve."""
    out = Catalog()
    taken = set(reserved)
    parsed: list[tuple[ModelDocument, ModelSettings]] = []
    for doc in docs:
        try:
            parsed.append((doc, parse_document(doc, key)))
        except ValueError as exc:
            out.invalid[doc.source] = str(exc)
    for doc, cfg in sorted(parsed, key=lambda p: (p[0].created, p[0].source)):
        name = cfg.name
        if name in taken:
            winner = out.served[name][0] if name in out.served else SETTINGS_SOURCE
            out.conflicts.append(Conflict(doc.source, name, winner))
            continue
        taken.add(name)
        out.served[name] = (doc.source, cfg)
    return out


class ConfigMapWatch:
    """Lists and watches the labelled ConfigMaps (one namespace or all) in a thread and
    hands every change, as the full list of documents, to ``on_change`` on the event
    loop."""

    def __init__(self, cfg: KubernetesModels, kube: KubeClient | None = None) -> None:
        """``kube``: the client (default: in-cluster config, else the kube config)."""
        self.cfg = cfg
        self._kube = kube
        self._watch: ListWatch | None = None
        self._stopped = False

    async def start(self, on_change: Callable[[list[ModelDocument]], None]) -> None:
        loop = asyncio.get_running_loop()
        if self._kube is None:
            try:
                self._kube = kube_client()
            except Exception as exc:  # no in-cluster config and no usable kube config
                raise RuntimeError(f"no Kubernetes API for kubernetes_models: {exc}") from exc
        key = self.cfg.key

        def deliver(docs: list[ModelDocument]) -> None:
            if not self._stopped:
                on_change(docs)

        def report(objects: dict[str, Any]) -> None:
            docs = [configmap_document(o, key) for o in objects.values()]
            loop.call_soon_threadsafe(deliver, docs)

        ns = self.cfg.namespace
        path = "/api/v1/configmaps" if ns is None else f"/api/v1/namespaces/{ns}/configmaps"
        self._watch = ListWatch(self._kube, path, self.cfg.label_selector,
                                self.cfg.watch_timeout_s, report, "configmaps")
        self._watch.start()

    async def stop(self) -> None:
        self._stopped = True
        if self._watch is not None:
            self._watch.stop()
            with contextlib.suppress(RuntimeError):
                await asyncio.to_thread(self._watch.join, JOIN_WAIT_S)
