"""A 403 from the API server (the service account lacks a permission) is reported, not
crashed on: the cluster's loop writes ``Degraded``/``Forbidden`` naming the refused call,
posts a Warning Event, keeps running and clears the condition once the call is allowed.
On the embedded cluster with the chart's Role: tests/charts/test_chart_install_cluster.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

from mooncake_operator import crd
from mooncake_operator.kube import KubeError
from mooncake_operator.reconcile import Reconciler
from mooncake_operator.runtime import OperatorState, run_cluster
from mooncake_operator.settings import OperatorSettings

from ..charts.fake_api import RecordingKube
from .manifests import example

NS = "serving"
DENIED = 'pods is forbidden: User "system:serviceaccount:serving:op" cannot create resource'


class DenyingKube(RecordingKube):
    """The recording fake, refusing pod creation while ``deny`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.deny = True

    async def request(self, method: str, url: str, body: Any = None,
                      content_type: str = "application/json",
                      query: dict[str, str] | None = None) -> Any:
        if self.deny and method == "POST" and url.endswith("/pods"):
            raise KubeError(403, DENIED, f"{method} {url}")
        return await super().request(method, url, body, content_type, query)


class LiveBody(Mapping[str, Any]):
    """The cluster object as the fake stores it now (kopf's live body)."""

    def __init__(self, kube: RecordingKube, name: str) -> None:
        self.kube, self.name = kube, name

    def _obj(self) -> dict[str, Any]:
        return self.kube.all(crd.GROUP, crd.PLURAL, NS)[self.name]

    def __getitem__(self, key: str) -> Any:
        return self._obj()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._obj())

    def __len__(self) -> int:
        return len(self._obj())


class StopAfter:
    """Falsy for ``n`` checks (loop rounds), then truthy."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __bool__(self) -> bool:
        self.n -= 1
        return self.n < 0


def _conditions(kube: RecordingKube) -> dict[str, tuple[str, str, str]]:
    st = kube.all(crd.GROUP, crd.PLURAL, NS)["llama"].get("status") or {}
    return {c["type"]: (c["status"], c["reason"], c["message"])
            for c in st.get("conditions") or []}


def _gauge(name: str, **labels: str) -> float:
    """The value of the operator's series ``name`` for cluster NS/llama (-1: none)."""
    from prometheus_client import REGISTRY

    want = {"cluster": f"{NS}/llama", **labels}
    for fam in REGISTRY.collect():
        for smp in fam.samples:
            if smp.name == name and smp.labels == want:
                return float(smp.value)
    return -1.0


def test_a_403_becomes_degraded_forbidden_and_clears() -> None:
    kube = DenyingKube()
    settings = OperatorSettings(busy_interval_s=0.01, resync_interval_s=0.01,
                                event_debounce_s=0)
    state = OperatorState(settings, kube, None, Reconciler(kube, None, settings))
    _, spec = example("simulated")
    data = spec.model_dump(by_alias=True, mode="json", exclude_none=True)
    data["store"]["enabled"] = False  # engine pods are created at once
    kube.put(crd.GROUP, crd.PLURAL, {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
        "metadata": {"name": "llama", "namespace": NS, "uid": "uid-c", "generation": 2},
        "spec": data})
    events: list[tuple[str, str, str]] = []
    in_a_row: list[float] = []  # the failures-in-a-row gauge at the start of each round

    def emit_for(_: Mapping[str, Any]) -> Any:
        in_a_row.append(_gauge("mooncake_operator_reconcile_failures_in_a_row"))
        return lambda kind, reason, message: events.append((kind, reason, message))

    body = LiveBody(kube, "llama")
    asyncio.run(run_cluster(state, body, StopAfter(3), emit_for))  # three denied rounds
    assert in_a_row == [-1, 1, 2], in_a_row  # none before the first round
    assert _gauge("mooncake_operator_reconcile_failures_in_a_row") == -1  # forgotten at stop
    conds = _conditions(kube)
    assert conds["Degraded"][:2] == ("True", "Forbidden"), conds
    assert conds["Ready"][:2] == ("False", "Forbidden"), conds
    msg = conds["Degraded"][2]
    assert DENIED in msg and f"POST /api/v1/namespaces/{NS}/pods" in msg, msg
    assert kube.all(crd.GROUP, crd.PLURAL, NS)["llama"]["status"]["observedGeneration"] == 2
    # one Warning per new error, no ReconcileError for a 403, no pods
    warnings = [(r, m) for k, r, m in events if k == "Warning"]
    assert [r for r, _ in warnings] == ["Forbidden", "Forbidden"], events  # Ready, Degraded
    assert not kube.all("", "pods", NS)

    kube.deny = False  # the Role is fixed: the next round creates the pods, the reason clears
    asyncio.run(run_cluster(state, body, StopAfter(1), emit_for))
    conds = _conditions(kube)
    assert conds["Degraded"][:2] == ("False", "AsExpected"), conds
    assert conds["Ready"][1] != "Forbidden", conds
    assert len(kube.all("", "pods", NS)) == 4
    assert any(r == "CreatedPods" for _, r, _ in events), events
