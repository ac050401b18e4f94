"""What a reconcile reads: the operator's own objects from kopf indexes, not from the API.

kopf watches every kind the operator creates (the objects labelled as managed by it) and
keeps each object in an in-memory index (``@kopf.index``, wired in :mod:`.handlers`). Each
object is indexed under two keys: its name, and the MooncakeCluster it belongs to. A
reconcile reads its children and pods from there. In steady state it sends the API server
only its writes; before, each pass sent one GET per child and six LISTs.

The indexes lag the API by one watch event. Two things keep that lag harmless:
- **Read your writes.** Every write that lands (:attr:`~.kube.Kube.on_written`) is kept
  beside the index until the index shows that version or a later one, or
  :data:`WRITE_MEMORY_S` pass. A pass that follows a burst of pod creations sees every
  pod it made, as client-go's controller "expectations" do, instead of creating them
  again and reporting fewer pods than exist.
- **Level-based writes.** What the memory cannot cover (another writer's change not yet
  seen) costs one request, never a wrong write: a create that finds the object ends in
  409 and the reconciler reads it live
  (:meth:`~.reconcile.Reconciler._apply_children`); a patch on a stale version ends in
  409 and is reconciled again; a delete of an object already gone ends in 404.

kopf fills every index before it starts any other handler, so the first reconcile after a
restart already sees every child. Kinds that are not indexed (Nodes, Leases, the
MooncakeCluster itself), and selectors that do not name a cluster, go to the API.

**Audits.** When a watch breaks and its resourceVersion has expired (410 Gone, as after an
API server restart), kopf lists again and indexes what the list holds, but it never drops
what the list no longer holds: an object deleted while the watch was down would stay in
the index for good, and the reconciler would never make it again. So every
``audit_s`` each cluster's list of each kind is read from the API once, and an indexed
object the API no longer has is read as deleted from then on (logged and counted; its
name's new incarnation is read beside it).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mooncake_contract import conventions as c

from .kube import resource
from .metrics import INDEX_GHOSTS

log = logging.getLogger(__name__)
JsonDict = dict[str, Any]
#: an index key: (namespace, "name" | "cluster", value)
IndexKey = tuple[str, str, str]
BY_NAME = "name"
BY_CLUSTER = "cluster"

#: seconds a write is read back before the index must show it: far longer than a watch
#: event takes to arrive; only a watch that breaks and lists again takes longer
WRITE_MEMORY_S = 30.0

#: the kinds the reconciler makes besides engine pods (builders.children)
CHILD_KINDS = ("Service", "Deployment", "DaemonSet", "ConfigMap", "NetworkPolicy")
#: kind -> (API group, version, plural) of every kind the operator creates and indexes
INDEXED: dict[str, tuple[str, str, str]] = {k: resource(k) for k in ("Pod", *CHILD_KINDS)}


class Reader(Protocol):
    """Reads of namespaced objects as plain dicts (:class:`~.kube.Kube` is one)."""

    async def get(self, kind: str, namespace: str, name: str) -> JsonDict | None: ...

    async def list(self, kind: str, namespace: str, selector: str | None = None
                   ) -> list[JsonDict]: ...


def index_id(kind: str) -> str:
    """The kopf index's id, which is also the keyword kopf passes it to handlers under."""
    return f"mooncake_{INDEXED[kind][2]}"


def entries(body: Mapping[str, Any]) -> dict[IndexKey, JsonDict]:
    """What a kopf index keeps of one object: a plain copy, under its name and under its
    cluster (when it carries the cluster label)."""
    obj: JsonDict = copy.deepcopy(dict(body))
    meta = obj.get("metadata") or {}
    ns = str(meta.get("namespace") or "")
    out: dict[IndexKey, JsonDict] = {(ns, BY_NAME, str(meta.get("name"))): obj}
    cluster = (meta.get("labels") or {}).get(c.LABEL_CLUSTER)
    if cluster:
        out[(ns, BY_CLUSTER, str(cluster))] = obj
    return out


def parse_selector(selector: str | None) -> dict[str, str] | None:
    """An equality-based label selector (``a=b,c=d``) as a dict; None for anything else
    (set-based terms, ``!=``, ``!key``), which the cache does not serve."""
    out: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        key, eq, value = term.partition("=")
        if not eq or "!" in key or value.startswith("=") or " " in key:
            return None
        out[key] = value
    return out


#: what kopf hands a handler for one index: key -> the values stored under it
IndexView = Mapping[IndexKey, Collection[JsonDict]]


@dataclass(frozen=True, slots=True)
class _Write:
    """A write that landed: the object as the API answered, or None once gone (then the
    uid of the incarnation deleted, when known)."""

    obj: JsonDict | None
    uid: str | None
    at: float

    def expired(self, now: float) -> bool:
        """Kept past :data:`WRITE_MEMORY_S`: the index is read as it is."""
        return now - self.at > WRITE_MEMORY_S


def _version(obj: JsonDict | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")


def _uid(obj: JsonDict | None) -> str | None:
    uid = ((obj or {}).get("metadata") or {}).get("uid")
    return str(uid) if uid else None


def _caught_up(indexed: JsonDict | None, w: _Write) -> bool:
    """Whether the index shows ``w`` or something later."""
    if w.obj is None:  # gone: until that incarnation leaves the index
        return indexed is None or (w.uid is not None and _uid(indexed) != w.uid)
    if indexed is None:
        return False
    have, wrote = _version(indexed), _version(w.obj)
    # resourceVersions are etcd revisions; compared as numbers only when both are
    return have == wrote or (have.isdigit() and wrote.isdigit() and int(have) > int(wrote))


class IndexedReader:
    """:class:`Reader` over kopf's indexes (``indexes[kind]``) and this process's own
    recent writes (:meth:`written`); the rest through ``fallback``. Results are the
    index's own objects: read them, do not change them."""

    def __init__(self, indexes: Mapping[str, IndexView], fallback: Reader,
                 audit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.indexes = indexes
        self.fallback = fallback
        self.audit_s = audit_s
        self.clock = clock
        #: kind -> (namespace, name) -> our write not yet seen in the index
        self._writes: dict[str, dict[tuple[str, str], _Write]] = {k: {} for k in indexes}
        #: kind -> uids of indexed objects the API no longer has
        self._ghosts: dict[str, set[str]] = {k: set() for k in indexes}
        #: (kind, namespace, selector) -> when that list is next checked against the API
        self._audits: dict[tuple[str, str, str], float] = {}

    def written(self, kind: str, namespace: str, name: str, obj: JsonDict | None,
                uid: str | None = None) -> None:
        """A write landed (:attr:`~.kube.Kube.on_written`): read it back until the index
        shows it."""
        writes = self._writes.get(kind)
        if writes is None:
            return
        now = self.clock()
        # forget what no pass read back in time (a deleted cluster's children, old pods)
        for key in [k for k, w in writes.items() if w.expired(now)]:
            del writes[key]
        writes[(namespace, name)] = _Write(obj, uid, now)

    def _current(self, kind: str, namespace: str, name: str, index: IndexView
                 ) -> JsonDict | None:
        """The object under ``name``: the index's (unless an audit found it gone), or a
        newer write of ours."""
        ghosts = self._ghosts[kind]
        # beside a ghost the index may hold the name's new incarnation
        indexed = next((o for o in index.get((namespace, BY_NAME, name), ())
                        if _uid(o) not in ghosts), None)
        writes = self._writes[kind]
        w = writes.get((namespace, name))
        if w is None:
            return indexed
        if _caught_up(indexed, w) or w.expired(self.clock()):
            del writes[(namespace, name)]
            return indexed
        return w.obj

    async def get(self, kind: str, namespace: str, name: str) -> JsonDict | None:
        index = self.indexes.get(kind)
        if index is None:
            return await self.fallback.get(kind, namespace, name)
        return self._current(kind, namespace, name, index)

    async def list(self, kind: str, namespace: str, selector: str | None = None
                   ) -> list[JsonDict]:
        index = self.indexes.get(kind)
        terms = parse_selector(selector)
        if index is None or terms is None or c.LABEL_CLUSTER not in terms:
            return await self.fallback.list(kind, namespace, selector)
        bucket = index.get((namespace, BY_CLUSTER, terms[c.LABEL_CLUSTER]), ())
        now = self.clock()
        key = (kind, namespace, selector or "")
        if now >= self._audits.setdefault(key, now + self.audit_s):
            self._audits[key] = now + self.audit_s
            await self._audit(kind, namespace, selector, terms, bucket)
        names = {str(o["metadata"]["name"]) for o in bucket}
        names |= {n for (ns, n) in self._writes[kind] if ns == namespace}
        out = []
        for name in sorted(names):
            obj = self._current(kind, namespace, name, index)
            if obj is not None and _labelled(obj, terms):
                out.append(obj)
        return out

    async def _audit(self, kind: str, namespace: str, selector: str | None,
                     terms: dict[str, str], bucket: Collection[JsonDict]) -> None:
        """Hide what the index holds under ``selector`` and the API no longer has."""
        live = {_uid(o) for o in await self.fallback.list(kind, namespace, selector)}
        ghosts = self._ghosts[kind]
        for obj in bucket:
            uid = _uid(obj)
            if uid is None or uid in live or uid in ghosts or not _labelled(obj, terms):
                continue
            log.warning("%s %s/%s: in kopf's index but gone from the API (a deletion its "
                        "watch missed); read as deleted", kind, namespace,
                        obj["metadata"]["name"])
            INDEX_GHOSTS.labels(kind).inc()
            ghosts.add(uid)


def _labelled(obj: JsonDict, terms: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in terms.items())
