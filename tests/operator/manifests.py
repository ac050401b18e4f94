"""Shared by the operator's tests: example specs and the manifests built from them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from mooncake_operator.names import ClusterRef
from mooncake_operator.settings import OperatorSettings
from mooncake_operator.spec import MooncakeClusterSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "clusters"
SETTINGS = OperatorSettings(image="ghcr.io/mooncake-operator/mooncake-operator:0.1.0")


def example(name: str) -> tuple[ClusterRef, MooncakeClusterSpec]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    ref = ClusterRef(doc["metadata"]["name"], "serving", "uid-1234", 1)
    return ref, MooncakeClusterSpec.model_validate(doc["spec"])


def replaced(doc: dict[str, Any], path: str, value: Any, sep: str = ".") -> dict[str, Any]:
    """A deep copy of ``doc`` with the field at ``path`` (keys joined with ``sep``; missing
    parents created) set to ``value``."""
    out = copy.deepcopy(doc)
    node = out
    *head, last = path.split(sep)
    for k in head:
        node = node.setdefault(k, {})
    node[last] = value
    return out


def with_updates(spec: MooncakeClusterSpec, **updates: Any) -> MooncakeClusterSpec:
    """``spec`` with fields replaced, each named by its camelCase path joined with ``__``
    (``prefill__replicas=7``, ``engine__extraArgs=[...]``), validated again."""
    data = spec.model_dump(by_alias=True)
    for path, value in updates.items():
        data = replaced(data, path, value, sep="__")
    return MooncakeClusterSpec.model_validate(data)
