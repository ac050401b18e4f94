"""A recording in-memory stand-in for the API server behind :class:`~mooncake_operator.kube.
Kube`: every request is recorded as the RBAC (apiGroup, resource, verb) it needs, and
answered well enough for the reconciler to go through its paths (create, patch on a changed
hash, orphan delete, pod create, drain, delete). Not a model of the API's semantics."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from mooncake_operator.kube import Kube, KubeError

JsonDict = dict[str, Any]
VERBS = {"POST": "create", "PATCH": "patch", "DELETE": "delete"}


def parse(url: str) -> tuple[str, str, str, str | None, str | None]:
    """(apiGroup, plural, namespace, name, subresource) of an API path (namespace ``""``
    for a cluster-scoped one)."""
    parts = url.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    if rest[0] == "namespaces":
        ns, rest = rest[1], rest[2:]
    else:
        ns = ""
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    return group, plural, ns, name, sub


def _matches(obj: JsonDict, selector: str | None) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class RecordingKube(Kube):
    def __init__(self) -> None:
        super().__init__(api_client=None, field_manager="test")
        self.objects: dict[tuple[str, str, str], dict[str, JsonDict]] = {}
        self.used: set[tuple[str, str, str]] = set()
        self._uids = itertools.count(1)
        self._versions = itertools.count(1)

    def put(self, group: str, plural: str, obj: JsonDict) -> JsonDict:
        meta = obj["metadata"]
        meta.setdefault("uid", f"uid-{next(self._uids)}")
        meta["resourceVersion"] = str(next(self._versions))
        self.objects.setdefault((group, plural, meta.get("namespace", "")), {})[
            meta["name"]] = obj
        return obj

    def all(self, group: str, plural: str, ns: str) -> dict[str, JsonDict]:
        return self.objects.setdefault((group, plural, ns), {})

    async def request(self, method: str, url: str, body: Any = None,
                      content_type: str = "application/json",
                      query: dict[str, str] | None = None) -> Any:
        group, plural, ns, name, sub = parse(url)
        verb = ("get" if name is not None else "list") if method == "GET" else VERBS[method]
        self.used.add((group, f"{plural}/{sub}" if sub else plural, verb))
        store = self.all(group, plural, ns)
        if method == "GET" and name is None:
            sel = (query or {}).get("labelSelector")
            return {"items": [copy.deepcopy(o) for o in store.values() if _matches(o, sel)]}
        if method == "POST":
            name = body["metadata"]["name"]
            if name in store:
                raise KubeError(409, "exists")
            return copy.deepcopy(self.put(group, plural, copy.deepcopy(body)))
        assert name is not None
        if name not in store:
            raise KubeError(404, "not found")
        if method == "GET":
            return copy.deepcopy(store[name])
        if method == "PATCH":
            want = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if want not in (None, store[name]["metadata"].get("resourceVersion")):
                raise KubeError(409, "the object has been modified")
            store[name] = merge_patch(store[name], body)
            store[name]["metadata"]["resourceVersion"] = str(next(self._versions))
            return copy.deepcopy(store[name])
        pre = (body or {}).get("preconditions") or {}
        if pre.get("uid") not in (None, store[name]["metadata"]["uid"]):
            raise KubeError(409, "uid precondition")
        del store[name]
        return {}
