"""Writes carry the resourceVersion they were computed from: a status computed from a
stale read (a spec changed meanwhile, a replica that lost the lease while it computed)
fails with 409 instead of landing, and a single conflict is reconciled again at once,
without a Warning Event."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

import pytest
from mooncake_operator import builders, crd
from mooncake_operator.kube import KubeError
from mooncake_operator.reconcile import Reconciler
from mooncake_operator.runtime import OperatorState, run_cluster
from mooncake_operator.settings import OperatorSettings

from ..charts.fake_api import RecordingKube
from .manifests import example
from .test_forbidden import LiveBody, StopAfter

NS = "serving"


def _cluster(kube: RecordingKube, replicas: int = 2) -> dict[str, Any]:
    _, spec = example("simulated")
    data = spec.model_dump(by_alias=True, mode="json", exclude_none=True)
    data["store"]["enabled"] = False
    data["prefill"]["replicas"] = replicas
    return kube.put(crd.GROUP, crd.PLURAL, {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
        "metadata": {"name": "llama", "namespace": NS, "uid": "uid-c", "generation": 1},
        "spec": data})


def _stored(kube: RecordingKube) -> dict[str, Any]:
    return kube.all(crd.GROUP, crd.PLURAL, NS)["llama"]


def _quiet(*_: str) -> None:
    pass


def test_a_status_from_a_stale_read_does_not_land() -> None:
    kube = RecordingKube()
    rec = Reconciler(kube, None, OperatorSettings())
    stale = copy.deepcopy(_cluster(kube))
    asyncio.run(rec.reconcile(copy.deepcopy(stale), _quiet))  # pods made, status written
    written = copy.deepcopy(_stored(kube)["status"])
    assert written["prefill"]["desired"] == 2
    # the user scales up; a replica still holding the old read computes from it
    obj = _stored(kube)
    obj["spec"]["prefill"]["replicas"] = 3
    obj["metadata"]["generation"] = 2
    kube.put(crd.GROUP, crd.PLURAL, obj)
    stale["status"] = {}  # what it read before its own first write
    with pytest.raises(KubeError) as err:
        asyncio.run(rec.reconcile(stale, _quiet))
    assert err.value.status == 409
    assert _stored(kube)["status"] == written
    # the fresh read goes through
    asyncio.run(rec.reconcile(copy.deepcopy(_stored(kube)), _quiet))
    assert _stored(kube)["status"]["prefill"]["desired"] == 3


def test_a_child_patch_names_the_version_it_read() -> None:
    kube = RecordingKube()
    rec = Reconciler(kube, None, OperatorSettings())
    body = _cluster(kube)
    asyncio.run(rec.reconcile(copy.deepcopy(body), _quiet))
    cm = next(iter(kube.all("", "configmaps", NS).values()))
    sent: list[dict[str, Any]] = []
    patch = kube.patch

    async def recording(kind: str, namespace: str, name: str, b: dict[str, Any],
                        *args: Any, **kw: Any) -> Any:
        sent.append(b)
        return await patch(kind, namespace, name, b, *args, **kw)

    kube.patch = recording  # type: ignore[method-assign]
    version = cm["metadata"]["resourceVersion"]
    cm["metadata"]["annotations"][builders.SPEC_HASH_ANNOTATION] = "edited-by-hand"
    asyncio.run(rec.reconcile(copy.deepcopy(_stored(kube)), _quiet))
    cm_patches = [b for b in sent if b.get("data") is not None]
    assert cm_patches and cm_patches[0]["metadata"]["resourceVersion"] == version


class ConflictOnceKube(RecordingKube):
    """Answers the first status patch with 409, as the API server does for a stale
    resourceVersion."""

    def __init__(self) -> None:
        super().__init__()
        self.conflicts = 1

    async def request(self, method: str, url: str, body: Any = None,
                      content_type: str = "application/json",
                      query: dict[str, str] | None = None) -> Any:
        if self.conflicts and method == "PATCH" and url.endswith("/status"):
            self.conflicts -= 1
            raise KubeError(409, "the object has been modified", f"{method} {url}")
        return await super().request(method, url, body, content_type, query)


def test_one_conflict_is_reconciled_again_without_an_event() -> None:
    kube = ConflictOnceKube()
    settings = OperatorSettings(busy_interval_s=0.01, resync_interval_s=0.01,
                                event_debounce_s=0)
    state = OperatorState(settings, kube, None, Reconciler(kube, None, settings))
    _cluster(kube)
    events: list[tuple[str, str, str]] = []

    def emit_for(_: Mapping[str, Any]) -> Any:
        return lambda kind, reason, message: events.append((kind, reason, message))

    asyncio.run(run_cluster(state, LiveBody(kube, "llama"), StopAfter(2), emit_for))
    assert kube.conflicts == 0
    assert _stored(kube)["status"]["prefill"]["desired"] == 2  # landed on the second try
    assert not [e for e in events if e[1] == "ReconcileError"], events
