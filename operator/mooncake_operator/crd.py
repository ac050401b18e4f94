"""The MooncakeCluster CustomResourceDefinition, generated from :mod:`.spec`.

``python -m mooncake_operator.crd --write`` (or ``mooncake-operator operator crd
--write``) renders ``crds/mooncake.io_mooncakeclusters.yaml``; a test regenerates it and
fails when the committed file differs, so the pydantic models stay the one source.

Pydantic's JSON schema is turned into a *structural* OpenAPI v3 schema the API server
accepts: references inlined, ``X | None`` as ``nullable``, numeric exclusive bounds in
OpenAPI 3.0 form, free-form maps as ``x-kubernetes-preserve-unknown-fields``, and
defaults for nested objects and lists built by ``default_factory`` (so the API server
fills them before CEL rules read them).

API group ``mooncake.io``: the prefix every label and annotation of the project already
carries (``mooncake.io/cluster``, ``mooncake.io/replicas``), so users grep one name;
not under ``*.k8s.io`` / ``*.kubernetes.io`` (reserved for API-reviewed groups); short in
``kubectl`` output. ``v1alpha1``: fields may still change.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from mooncake_contract.conventions import DOMAIN
from pydantic import BaseModel

from . import spec as s

GROUP = DOMAIN
VERSION = "v1alpha1"
KIND = "MooncakeCluster"
PLURAL = "mooncakeclusters"
SINGULAR = "mooncakecluster"
SHORT_NAMES = ["mcc"]
CATEGORIES = ["mooncake"]
CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{GROUP}_{PLURAL}.yaml"
#: Where the committed CRD lives, relative to the repository root.
CRD_DIR = "crds"
#: The Helm chart's copy (Helm installs ``crds/`` of a chart; it cannot reach outside the
#: chart): written and checked together with :data:`CRD_DIR`'s.
CHART_CRD_DIR = "charts/mooncake-operator/crds"

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Ready", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
     "description": "Every desired pod of the current revision is ready and registered"},
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary",
     "description": "Prefill pods ready/desired"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary",
     "description": "Decode pods ready/desired"},
    {"name": "Store", "type": "string", "jsonPath": ".status.store.state",
     "description": "Mooncake Store state"},
    {"name": "Policy", "type": "string", "jsonPath": ".spec.conductor.policy",
     "description": "Conductor prefill policy"},
    {"name": "Revision", "type": "string", "jsonPath": ".status.revision",
     "description": "Engine revision the pools converge to"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

#: The one restriction a CRD may put on metadata: pod and Service names add a role, a
#: revision and an ordinal to the cluster's name.
METADATA_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": s.MAX_NAME_LENGTH}},
}

_DROP = {"title"}


def _models_by_name(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every pydantic model reachable from ``root``'s fields, by class name (the keys of
    pydantic's ``$defs``)."""
    out: dict[str, type[BaseModel]] = {}

    def visit(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp.__name__ in out:
                return
            out[tp.__name__] = tp
            for f in tp.model_fields.values():
                visit(f.annotation)
            return
        for arg in getattr(tp, "__args__", ()) or ():
            visit(arg)

    visit(root)
    return out


def _factory_default(model: type[BaseModel], alias: str) -> Any:
    """The schema default of a field built by ``default_factory`` (``{}`` for a nested
    model: the API server then fills its fields' own defaults), or ``None``."""
    for name, f in model.model_fields.items():
        if (f.alias or name) != alias or f.default_factory is None:
            continue
        value = f.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            # whole, not {}: the API server checks CEL rules against the default itself
            return value.model_dump(by_alias=True, mode="json", exclude_none=True)
        return copy.deepcopy(value)
    return None


class _Converter:
    def __init__(self, root: type[BaseModel]) -> None:
        self.schema = root.model_json_schema(by_alias=True, mode="validation")
        self.defs: dict[str, Any] = self.schema.pop("$defs", {})
        self.models = _models_by_name(root)
        self.root = root

    def convert(self) -> dict[str, Any]:
        return self._node(self.schema, self.root)

    def _deref(self, node: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        ref = node.get("$ref")
        if ref is None:
            return node, None
        name = ref.rsplit("/", 1)[-1]
        merged = {**copy.deepcopy(self.defs[name]), **{k: v for k, v in node.items()
                                                        if k != "$ref"}}
        return merged, name

    def _node(self, node: dict[str, Any], model: type[BaseModel] | None) -> dict[str, Any]:
        node, ref_name = self._deref(node)
        if ref_name is not None:
            model = self.models.get(ref_name)
        any_of = node.get("anyOf")
        nullable = False
        if any_of and not node.get("x-kubernetes-int-or-string"):
            rest = [x for x in any_of if x.get("type") != "null"]
            if len(rest) == 1 and len(rest) < len(any_of):
                nullable = True
                inner, inner_ref = self._deref(rest[0])
                if inner_ref is not None:
                    model = self.models.get(inner_ref)
                node = {**inner, **{k: v for k, v in node.items() if k != "anyOf"}}
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DROP or key == "$ref":
                continue
            if key == "default" and value is None:
                continue
            if key == "description":
                out[key] = " ".join(str(value).split())  # docstrings: one line
                continue
            if key == "properties":
                out["properties"] = {
                    name: self._property(sub, model, name) for name, sub in value.items()
                }
            elif key == "items":
                out["items"] = self._node(value, None)
            elif key == "additionalProperties":
                if value is True:
                    out["x-kubernetes-preserve-unknown-fields"] = True
                elif isinstance(value, dict):
                    out["additionalProperties"] = self._node(value, None)
                # False: the structural schema prunes unknown fields anyway
            elif key == "exclusiveMinimum" and not isinstance(value, bool):
                out["minimum"] = value
                out["exclusiveMinimum"] = True
            elif key == "exclusiveMaximum" and not isinstance(value, bool):
                out["maximum"] = value
                out["exclusiveMaximum"] = True
            else:
                out[key] = copy.deepcopy(value)
        if nullable:
            out["nullable"] = True
        if out.get("type") == "object" and "properties" not in out and \
                "additionalProperties" not in out:
            out["x-kubernetes-preserve-unknown-fields"] = True
        return out

    def _property(self, sub: dict[str, Any], model: type[BaseModel] | None,
                  alias: str) -> dict[str, Any]:
        field_model = model
        out = self._node(sub, None)
        if "default" not in out and field_model is not None:
            default = _factory_default(field_model, alias)
            if default is not None:
                out["default"] = default
        return out


def openapi_schema() -> dict[str, Any]:
    """The CRD's ``openAPIV3Schema``."""
    spec_schema = _Converter(s.MooncakeClusterSpec).convert()
    status_schema = _Converter(s.MooncakeClusterStatus).convert()
    return {
        "type": "object",
        "description": "MooncakeCluster: a prefill pool, a decode pool, a Mooncake Store and "
                       "a KV-cache-aware front door (the Conductor) for one model.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version of the object."},
            "kind": {"type": "string", "description": "Kind of the object."},
            "metadata": copy.deepcopy(METADATA_SCHEMA),
            "spec": spec_schema,
            "status": status_schema,
        },
    }


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "mooncake-operator",
                       "app.kubernetes.io/part-of": "mooncake-operator"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": SINGULAR, "shortNames": list(SHORT_NAMES),
                      "categories": list(CATEGORIES)},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {"status": {}},
                "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
            }],
        },
    }


HEADER = (
    "# Generated by `mooncake-operator operator crd --write` from\n"
    "# operator/mooncake_operator/spec.py. Do not edit by hand: a test fails when this file\n"
    "# and the models differ.\n"
)


def render() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)


def repo_root() -> Path:
    """The source checkout this module runs from."""
    return Path(__file__).resolve().parents[2]


def default_path() -> Path:
    """``crds/`` of the source checkout this module runs from."""
    return repo_root() / CRD_DIR / CRD_FILE


def chart_path() -> Path:
    """The Helm chart's copy in the source checkout this module runs from."""
    return repo_root() / CHART_CRD_DIR / CRD_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="render the MooncakeCluster CRD")
    parser.add_argument("--write", action="store_true",
                        help=f"write {CRD_DIR}/{CRD_FILE} and the chart's copy in "
                        f"{CHART_CRD_DIR}/")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a committed copy differs")
    parser.add_argument("--path", type=Path, default=None,
                        help="write or check this file only")
    args = parser.parse_args(argv)
    paths = [args.path] if args.path else [default_path(), chart_path()]
    text = render()
    if args.write:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
        return 0
    if args.check:
        stale = [p for p in paths
                 if (p.read_text(encoding="utf-8") if p.exists() else "") != text]
        for path in stale:
            print(f"{path} is out of date: run `mooncake-operator operator crd --write`",
                  file=sys.stderr)
        if stale:
            return 1
        print("up to date: " + ", ".join(str(p) for p in paths))
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
