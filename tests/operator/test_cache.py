"""The reconciler reads its children and pods from kopf's indexes (``cache.py``).

The indexes here are kopf's own (``OperatorIndexer``), filled through the operator's own
index function (``handlers.index_children``) from a recording fake API, as kopf's watch
would fill them. The end-to-end suite checks the same against the real API server
(``test_e2e.py``, a steady operator reads nothing)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

import pytest
from kopf._core.engines.indexing import OperatorIndexer
from mooncake_contract import conventions as c
from mooncake_operator import cache, crd, handlers, names
from mooncake_operator.cache import IndexedReader
from mooncake_operator.reconcile import Outcome, Reconciler
from mooncake_operator.settings import OperatorSettings

from ..charts.fake_api import RecordingKube
from .manifests import replaced

NS = "serving"
SETTINGS = OperatorSettings(gateway_pod_labels={"app": "gateway"})
AUDIT_S = SETTINGS.index_audit_interval_s
Key = tuple[str, str | None, str | None]


class Watch:
    """kopf's side in miniature: every object of the fake API that carries the operator's
    labels goes through ``handlers.index_children`` into a kopf ``OperatorIndexer``, and
    objects gone from the API leave it, each time :meth:`deliver` runs."""

    def __init__(self, kube: RecordingKube) -> None:
        self.kube = kube
        self.indexers = {kind: OperatorIndexer() for kind in cache.INDEXED}
        self.known: dict[str, set[Key]] = {kind: set() for kind in cache.INDEXED}

    @property
    def indexes(self) -> dict[str, Any]:
        return {kind: ix.index for kind, ix in self.indexers.items()}

    def deliver(self, purge: bool = True) -> None:
        """Index what the API holds; ``purge=False`` keeps what it no longer holds, as
        kopf does when a broken watch lists again."""
        for kind, (group, _, plural) in cache.INDEXED.items():
            seen: set[Key] = set()
            for (g, p, _ns), objs in self.kube.objects.items():
                if (g, p) != (group, plural):
                    continue
                for obj in objs.values():
                    labels = obj["metadata"].get("labels") or {}
                    if any(labels.get(k) != v for k, v in handlers.OUR_LABELS.items()):
                        continue
                    meta = obj["metadata"]
                    key: Key = (meta.get("namespace"), meta["name"], meta["uid"])
                    self.indexers[kind].replace(key, handlers.index_children(body=obj))
                    seen.add(key)
            if purge:
                for key in self.known[kind] - seen:
                    self.indexers[kind].discard(key)
                self.known[kind] = seen
            else:
                self.known[kind] |= seen


def _spec() -> dict[str, Any]:
    """examples/clusters/simulated.yaml's spec (inline: the mutation runs copy tests/)."""
    return {
        "model": {"name": "llama3-70b-sim", "blockSize": 16, "maxModelLen": 131072},
        "engine": {"kind": "simulated", "simulated": {"timeScale": 0.5}},
        "prefill": {"replicas": 2, "gpusPerReplica": 8},
        "decode": {"replicas": 2, "gpusPerReplica": 8},
        "store": {"segmentSize": "64Mi", "memoryLimit": "512Mi"},
        "conductor": {"policy": "conductor"},
    }


def _put_cluster(kube: RecordingKube, spec: dict[str, Any]) -> dict[str, Any]:
    return kube.put(crd.GROUP, crd.PLURAL, {
        "apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND,
        "metadata": {"name": "llama", "namespace": NS, "uid": "uid-cluster",
                     "generation": 1}, "spec": spec})


def _ready_everything(kube: RecordingKube) -> None:
    for pod in kube.all("", "pods", NS).values():
        pod["status"] = {"phase": "Running", "podIP": "10.0.0.1", "conditions": [
            {"type": "Ready", "status": "True"}]}
    for dep in kube.all("apps", "deployments", NS).values():
        dep["status"] = {"readyReplicas": 1, "replicas": 1}
    for ds in kube.all("apps", "daemonsets", NS).values():
        ds["status"] = {"desiredNumberScheduled": 1, "numberReady": 1}


def _indexed(kube: RecordingKube, watch: Watch, remember: bool = True,
             clock: Callable[[], float] = lambda: 0.0) -> Reconciler:
    """A reconciler reading through kopf's indexes, as the operator wires it
    (``OperatorState.create``); ``remember=False`` leaves out the memory of its writes."""
    reader = IndexedReader(watch.indexes, kube, SETTINGS.index_audit_interval_s, clock)
    kube.on_written = reader.written if remember else None
    return Reconciler(kube, None, SETTINGS, reader=reader)


def _cluster(kube: RecordingKube) -> dict[str, Any]:
    """The MooncakeCluster as the API holds it now (its status and resourceVersion)."""
    return copy.deepcopy(kube.all(crd.GROUP, crd.PLURAL, NS)["llama"])


def _settle(kube: RecordingKube) -> None:
    """A cluster brought to steady state through the API (children and pods made)."""
    _put_cluster(kube, _spec())
    rec = Reconciler(kube, None, SETTINGS)

    async def passes() -> None:
        for _ in range(4):
            await rec.reconcile(_cluster(kube), lambda *e: None)
            _ready_everything(kube)

    asyncio.run(passes())


def _once(rec: Reconciler, kube: RecordingKube) -> Outcome:
    return asyncio.run(rec.reconcile(_cluster(kube), lambda *e: None))


def test_a_steady_reconcile_reads_nothing_from_the_api() -> None:
    kube = RecordingKube()
    _settle(kube)
    watch = Watch(kube)
    watch.deliver()
    through_api = Reconciler(kube, None, SETTINGS)
    reads, writes = sum(kube.reads.values()), kube.total_writes
    direct = _once(through_api, kube)
    api_reads = sum(kube.reads.values()) - reads
    assert kube.total_writes == writes
    indexed = _indexed(kube, watch)
    reads = sum(kube.reads.values())
    cached = _once(indexed, kube)
    assert sum(kube.reads.values()) == reads, kube.reads
    assert kube.total_writes == writes
    assert cached.status == direct.status and not cached.progressing
    # the children (store Service, ConfigMap, Deployment, DaemonSet, NetworkPolicy) are
    # each read, and each kind and the pods are listed: what the indexes now save
    assert api_reads >= 11, kube.reads


def test_a_lagging_index_costs_a_request_not_a_wrong_write() -> None:
    """The index has not seen the children yet (its watch lags): creates end in 409, the
    live objects are read, and no child or pod is patched or deleted. The status reports
    what the index shows, and is right again once the watch delivers."""
    kube = RecordingKube()
    _settle(kube)
    settled = _cluster(kube)["status"]

    def versions() -> dict[Any, dict[str, str]]:
        return {k: {n: o["metadata"]["resourceVersion"] for n, o in objs.items()}
                for k, objs in kube.objects.items() if k[1] != crd.PLURAL}

    before = versions()
    lagging = Watch(kube)  # not delivered yet
    rec = _indexed(kube, lagging)
    writes = copy.copy(kube.writes)
    _once(rec, kube)
    done = kube.writes - writes
    assert set(done) <= {("create", k) for k in cache.INDEXED} | {
        ("patch-status", crd.KIND)}, done
    assert ("create", "Pod") in done and ("create", "Service") in done  # refused: 409
    assert versions() == before
    lagging.deliver()
    writes = copy.copy(kube.writes)
    _once(rec, kube)
    assert set(kube.writes - writes) <= {("patch-status", crd.KIND)}
    assert _strip_times(_cluster(kube)["status"]) == _strip_times(settled)
    writes = copy.copy(kube.writes)
    _once(rec, kube)
    assert kube.writes == writes  # and then a pass writes nothing


def _strip_times(status: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(status)
    for cond in out.get("conditions") or []:
        cond.pop("lastTransitionTime", None)
    return out


def _no_store() -> dict[str, Any]:
    return replaced(_spec(), "store.enabled", False)


def _pods(out: Outcome) -> tuple[int, int]:
    return out.status.prefill.current, out.status.decode.current


@pytest.mark.parametrize("remember", [True, False])
def test_a_pass_sees_the_pods_it_just_made(remember: bool) -> None:
    """The watch has not delivered the new pods yet. With the memory of its writes the
    next pass sees all of them and writes nothing; without it, it tries to create them
    again (409 each) and reports none."""
    kube = RecordingKube()
    _put_cluster(kube, _no_store())
    watch = Watch(kube)  # delivers nothing until told
    rec = _indexed(kube, watch, remember)
    first = _once(rec, kube)
    made = kube.writes[("create", "Pod")]
    assert made == 4 and _pods(first) == (0, 0)  # the status of what it saw before
    second = _once(rec, kube)
    again = kube.writes[("create", "Pod")] - made
    if remember:
        assert again == 0 and _pods(second) == (2, 2)
    else:
        assert again == 4 and _pods(second) == (0, 0)
    watch.deliver()
    third = _once(rec, kube)
    assert _pods(third) == (2, 2)
    assert kube.writes[("create", "Pod")] == made + again


def test_a_pass_does_not_see_a_pod_it_just_deleted() -> None:
    kube = RecordingKube()
    _put_cluster(kube, _no_store())
    watch = Watch(kube)
    rec = _indexed(kube, watch)
    _once(rec, kube)
    _ready_everything(kube)
    watch.deliver()
    _once(rec, kube)
    _put_cluster(kube, replaced(_no_store(), "prefill.replicas", 1))
    watch.deliver()
    _once(rec, kube)  # drains one prefill pod (an annotation)
    watch.deliver()
    out = _once(rec, kube)  # and deletes it; the watch has not said so yet
    assert kube.writes[("delete", "Pod")] == 1
    assert _pods(out) == (2, 2)  # the status of what it saw before deleting
    out = _once(rec, kube)
    assert kube.writes[("delete", "Pod")] == 1 and _pods(out) == (1, 2)


def test_a_write_is_read_back_until_the_index_shows_it_or_later() -> None:
    now = [1000.0]
    obj = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "10",
                        "labels": {c.LABEL_CLUSTER: "x"}}}
    ix = OperatorIndexer()
    reader = IndexedReader({"Pod": ix.index}, RecordingKube(), AUDIT_S,
                           clock=lambda: now[0])

    def get() -> Any:
        return asyncio.run(reader.get("Pod", "ns", "p"))

    def index(version: str) -> None:
        ix.replace(("ns", "p", "u1"), cache.entries(replaced(obj, "metadata.resourceVersion",
                                                             version)))

    reader.written("Pod", "ns", "p", obj)
    assert get() == obj  # not in the index yet
    index("9")
    assert get() == obj  # the index is behind our write
    index("11")
    assert get()["metadata"]["resourceVersion"] == "11"  # later: the index wins
    index("9")
    assert get()["metadata"]["resourceVersion"] == "9"  # and the memory is gone
    reader.written("Pod", "ns", "p", None, "u1")  # deleted
    assert get() is None
    now[0] += cache.WRITE_MEMORY_S + 1
    assert get()["metadata"]["resourceVersion"] == "9"  # forgotten after the memory span
    reader.written("Service", "ns", "p", obj)  # not an indexed kind here: not kept
    assert reader._writes == {"Pod": {}}
    reader.written("Pod", "ns", "never-read", obj)
    now[0] += cache.WRITE_MEMORY_S
    reader.written("Pod", "ns", "q", obj)
    assert set(reader._writes["Pod"]) == {("ns", "never-read"), ("ns", "q")}
    now[0] += 1
    reader.written("Pod", "ns", "r", obj)  # what no pass read back in time is forgotten
    assert set(reader._writes["Pod"]) == {("ns", "q"), ("ns", "r")}


def test_a_delete_hides_that_incarnation_until_the_index_drops_it() -> None:
    now = [1000.0]
    ix = OperatorIndexer()
    reader = IndexedReader({"Pod": ix.index}, RecordingKube(), AUDIT_S,
                           clock=lambda: now[0])

    def put(uid: str) -> None:
        ix.replace(("ns", "p", uid), cache.entries({"metadata": {
            "name": "p", "namespace": "ns", "uid": uid, "resourceVersion": "1"}}))

    def get() -> Any:
        return asyncio.run(reader.get("Pod", "ns", "p"))

    put("u1")
    reader.written("Pod", "ns", "p", None, "u1")
    assert get() is None and reader._writes["Pod"]  # the index still shows u1
    ix.discard(("ns", "p", "u1"))
    put("u2")  # a new incarnation: the delete is behind it
    assert get()["metadata"]["uid"] == "u2" and not reader._writes["Pod"]
    reader.written("Pod", "ns", "p", None)  # deleted, uid not known: hidden until gone
    assert get() is None
    now[0] += cache.WRITE_MEMORY_S  # the memory span is inclusive
    assert get() is None
    ix.discard(("ns", "p", "u2"))
    assert get() is None and not reader._writes["Pod"]


def test_kinds_and_selectors_the_index_does_not_hold_go_to_the_api() -> None:
    kube = RecordingKube()
    kube.put("coordination.k8s.io", "leases", {"metadata": {
        "name": "lead", "namespace": NS, "labels": {c.LABEL_CLUSTER: "llama"}}})
    reader = IndexedReader({"Pod": OperatorIndexer().index}, kube, AUDIT_S)

    async def reads() -> tuple[Any, list[Any]]:
        return (await reader.get("Lease", NS, "lead"),
                await reader.list("Lease", NS, f"{c.LABEL_CLUSTER}=llama"))

    got, listed = asyncio.run(reads())
    assert got is not None and got["metadata"]["name"] == "lead"
    assert [o["metadata"]["name"] for o in listed] == ["lead"]
    assert kube.reads == {("get", "Lease"): 1, ("list", "Lease"): 1}


def test_an_unlabelled_object_in_a_childs_name_is_taken_over() -> None:
    """An object the index never sees (not labelled as ours) but holding a child's name:
    the create finds it, the reconciler reads it and patches it to the spec, as it did
    when it read every child from the API."""
    kube = RecordingKube()
    _settle(kube)
    cm = kube.all("", "configmaps", NS)[names.gateway_configmap("llama")]
    want = copy.deepcopy(cm["data"])
    cm["metadata"]["labels"] = {}
    cm["metadata"]["annotations"] = {}
    cm["data"] = {key: "edited by hand" for key in want}
    watch = Watch(kube)
    watch.deliver()
    rec = _indexed(kube, watch)
    _once(rec, kube)
    cm = kube.all("", "configmaps", NS)[names.gateway_configmap("llama")]
    assert cm["metadata"]["labels"][c.LABEL_MANAGED_BY] == c.MANAGED_BY
    assert cm["data"] == want


def test_a_spec_change_patches_from_the_index() -> None:
    kube = RecordingKube()
    _settle(kube)
    watch = Watch(kube)
    watch.deliver()
    rec = _indexed(kube, watch)
    _put_cluster(kube, replaced(_spec(), "store.master.rpcPort", 50061))
    reads = sum(kube.reads.values())
    _once(rec, kube)
    assert ("patch", "Service") in kube.writes and ("patch", "Deployment") in kube.writes
    assert sum(kube.reads.values()) == reads
    svc = kube.all("", "services", NS)[names.store_service("llama")]
    assert 50061 in {p["port"] for p in svc["spec"]["ports"]}


def test_an_audit_hides_a_deletion_the_watch_missed() -> None:
    """A pod deleted while kopf's watch was down: kopf lists again but keeps the pod in its
    index. Until the audit, the reconciler believes it; at the audit it reads the pod as
    deleted and makes it again, and the pod's new incarnation is read beside the ghost."""
    from mooncake_operator.metrics import INDEX_GHOSTS

    kube = RecordingKube()
    _put_cluster(kube, _no_store())
    watch = Watch(kube)
    now = [0.0]
    rec = _indexed(kube, watch, clock=lambda: now[0])
    _once(rec, kube)
    _ready_everything(kube)
    watch.deliver()
    assert _pods(_once(rec, kube)) == (2, 2)
    pods = kube.all("", "pods", NS)
    gone = sorted(n for n in pods if f"-{c.ROLE_PREFILL}-" in n)[0]
    old_uid = pods.pop(gone)["metadata"]["uid"]
    watch.deliver(purge=False)  # kopf's list after the broken watch: the pod stays
    ghosts = INDEX_GHOSTS.labels("Pod")._value.get()
    now[0] = AUDIT_S - 1
    creates = kube.writes[("create", "Pod")]
    assert _pods(_once(rec, kube)) == (2, 2)  # believed, until the audit
    assert kube.writes[("create", "Pod")] == creates
    now[0] = AUDIT_S
    reads = copy.copy(kube.reads)
    out = _once(rec, kube)
    assert kube.writes[("create", "Pod")] == creates + 1  # made again
    assert gone in pods and pods[gone]["metadata"]["uid"] != old_uid
    assert _pods(out) == (1, 2)
    assert INDEX_GHOSTS.labels("Pod")._value.get() == ghosts + 1
    # the audit listed the pods and each child kind once from the API
    assert (kube.reads - reads)[("list", "Pod")] == 1
    _ready_everything(kube)
    watch.deliver(purge=False)  # the new incarnation, beside the ghost
    now[0] = AUDIT_S + 1
    out = _once(rec, kube)
    assert _pods(out) == (2, 2)
    assert kube.writes[("create", "Pod")] == creates + 1
    assert INDEX_GHOSTS.labels("Pod")._value.get() == ghosts + 1  # counted once


class SelectorKube(RecordingKube):
    """Records the label selector of every list."""

    def __init__(self) -> None:
        super().__init__()
        self.selectors: list[tuple[str, str | None]] = []

    async def list(self, kind: str, namespace: str, selector: str | None = None
                   ) -> list[dict[str, Any]]:
        self.selectors.append((kind, selector))
        return await super().list(kind, namespace, selector)


def test_audits_run_per_list_once_an_interval_and_only_judge_what_they_listed(
        caplog: pytest.LogCaptureFixture) -> None:
    kube = SelectorKube()
    _settle(kube)
    watch = Watch(kube)
    watch.deliver()
    now = [1000.0]
    reader = IndexedReader(watch.indexes, kube, AUDIT_S, clock=lambda: now[0])
    prefill = f"{c.LABEL_CLUSTER}=llama,{c.LABEL_ROLE}={c.ROLE_PREFILL}"
    whole = f"{c.LABEL_CLUSTER}=llama"

    def names(selector: str) -> list[str]:
        return [o["metadata"]["name"] for o in asyncio.run(reader.list("Pod", NS, selector))]

    kube.selectors.clear()
    everyone = names(whole)
    before = names(prefill)
    assert before and not kube.selectors  # first sight: no audit yet
    pods = kube.all("", "pods", NS)
    gone = sorted(n for n in pods if f"-{c.ROLE_PREFILL}-" in n)[-1]
    del pods[gone]  # a deletion the watch missed (never delivered)
    now[0] += AUDIT_S
    with caplog.at_level("WARNING", logger="mooncake_operator.cache"):
        left = names(prefill)  # due: audited with its own selector
    assert kube.selectors == [("Pod", prefill)]
    assert left == [n for n in before if n != gone]
    assert any(f"Pod {NS}/{gone}" in r.getMessage() for r in caplog.records)
    # the decode pods were not in that audit's list and are not judged by it
    assert set(names(whole)) == set(everyone) - {gone}
    assert kube.selectors == [("Pod", prefill), ("Pod", whole)]  # its own first audit
    now[0] += 1
    names(prefill)
    names(whole)
    assert len(kube.selectors) == 2  # not again before the interval passes
    now[0] += AUDIT_S
    names(prefill)
    names(whole)
    assert kube.selectors[2:] == [("Pod", prefill), ("Pod", whole)]


def test_the_index_keys_an_object_by_name_and_by_cluster() -> None:
    obj = {"metadata": {"name": "p-0", "namespace": "ns", "labels": {c.LABEL_CLUSTER: "x"}}}
    got = cache.entries(obj)
    assert set(got) == {("ns", cache.BY_NAME, "p-0"), ("ns", cache.BY_CLUSTER, "x")}
    assert got[("ns", cache.BY_NAME, "p-0")] == obj
    obj["metadata"]["name"] = "changed"  # a plain copy: later changes do not leak in
    assert got[("ns", cache.BY_NAME, "p-0")]["metadata"]["name"] == "p-0"
    bare = {"metadata": {"name": "n", "namespace": "ns"}}
    assert set(cache.entries(bare)) == {("ns", cache.BY_NAME, "n")}
    cluster_scoped = {"metadata": {"name": "gpu-1"}}
    assert set(cache.entries(cluster_scoped)) == {("", cache.BY_NAME, "gpu-1")}


@pytest.mark.parametrize(("selector", "terms"), [
    ("a=b,c=d", {"a": "b", "c": "d"}),
    ("", {}),
    (None, {}),
    (" a=b , c=d ", {"a": "b", "c": "d"}),
    ("a!=b", None),
    ("a==b", None),
    ("a in (b)", None),
    ("!a", None),
    ("a", None),
    ("a b=c", None),
])
def test_parse_selector(selector: str | None, terms: dict[str, str] | None) -> None:
    assert cache.parse_selector(selector) == terms


def test_selectors_the_index_cannot_serve_go_to_the_api() -> None:
    kube = RecordingKube()
    _settle(kube)
    watch = Watch(kube)
    watch.deliver()
    reader = IndexedReader(watch.indexes, kube, AUDIT_S)

    async def reads() -> tuple[int, int, int, int]:
        sel = f"{c.LABEL_CLUSTER}=llama,{c.LABEL_ROLE}={c.ROLE_PREFILL}"
        from_index = await reader.list("Pod", NS, sel)
        before = sum(kube.reads.values())
        from_api = await reader.list("Pod", NS, f"{c.LABEL_ROLE}={c.ROLE_PREFILL}")
        node = await reader.get("Node", "", "gpu-1")
        assert node is None
        return len(from_index), len(from_api), before, sum(kube.reads.values())

    n_index, n_api, before, after = asyncio.run(reads())
    assert n_index == n_api > 0
    assert after - before == 2  # the list without a cluster, and the Node


def test_every_indexed_kind_has_an_index_and_a_wake_handler() -> None:
    import kopf

    registry = kopf.get_default_registry()
    indexed = {(h.selector.group or "", h.selector.any_name): h.id
               for h in registry._indexing.get_all_handlers() if h.selector is not None}
    waking = {(h.selector.group or "", h.selector.any_name)
              for h in registry._watching.get_all_handlers()
              if h.selector is not None and h.fn is handlers.child_changed}
    want = {(g, p): cache.index_id(k) for k, (g, _, p) in cache.INDEXED.items()}
    assert indexed == want
    assert waking == set(want)
