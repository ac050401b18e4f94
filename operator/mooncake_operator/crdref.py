"""The configuration reference, ``docs/reference.md``, rendered from the CRD (pure).

Every field of a ``MooncakeCluster`` — path, type, default, description, constraints —
and every CEL rule the API server checks, read from :func:`.crd.crd` (itself generated
from the pydantic models in :mod:`.spec`), so the page cannot say what the API does not.
``mooncake-operator operator crd --reference --write`` writes it; ``--check`` (and a test)
fails when the committed page differs.

One section per object of the schema (``spec``, ``spec.model``, ...; ``[]`` marks the
items of a list), each a table of its fields and the rules attached to it. A schema
keyword this module does not know raises, so a new kind of constraint in the CRD cannot
silently miss the page.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import crd as crdmod

#: where the page lives, relative to the repository root
REFERENCE_FILE = "docs/reference.md"

#: schema keywords rendered here (anything else in the CRD raises)
KNOWN_KEYS = frozenset({
    "type", "description", "properties", "required", "items", "additionalProperties",
    "default", "enum", "nullable", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "maxLength", "minItems", "maxItems", "pattern",
    "anyOf", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
})
#: Kubernetes' resource.Quantity pattern: shown as a word, not as the regex
QUANTITY_HINT = r"(([KMGTPE]i)|[numkMGTPE]"
#: a default longer than this (as JSON) is summarised
SHORT_DEFAULT = 48

Schema = dict[str, Any]


@dataclass
class Rule:
    rule: str
    message: str
    field_path: str


@dataclass
class Section:
    path: str
    description: str
    node: Schema
    rules: list[Rule] = field(default_factory=list)


def _check_keys(node: Schema, path: str) -> None:
    unknown = set(node) - KNOWN_KEYS
    if unknown:
        raise ValueError(f"{path}: schema keywords {sorted(unknown)} are not rendered; "
                         "teach operator/mooncake_operator/crdref.py about them")


def anchor(path: str) -> str:
    """GitHub's anchor of a heading ``path``: lower case, punctuation dropped."""
    return re.sub(r"[^a-z0-9_ -]", "", path.lower()).replace(" ", "-")


def _has_section(node: Schema) -> bool:
    return node.get("type") == "object" and bool(node.get("properties"))


def _child_paths(path: str, node: Schema) -> list[tuple[str, Schema]]:
    out = [(f"{path}.{name}", sub) for name, sub in (node.get("properties") or {}).items()]
    if isinstance(node.get("items"), dict):
        out.append((f"{path}[]", node["items"]))
    if isinstance(node.get("additionalProperties"), dict):
        out.append((f"{path}{{}}", node["additionalProperties"]))
    return out


def sections(root: Schema) -> list[Section]:
    """Object sections in document order (depth first), each with the CEL rules of its
    own node and of its fields that have no section of their own."""
    out: list[Section] = []

    def visit(path: str, node: Schema, owner: Section | None) -> None:
        _check_keys(node, path)
        here = owner
        if _has_section(node):
            here = Section(path, str(node.get("description", "")), node)
            out.append(here)
        for v in node.get("x-kubernetes-validations") or []:
            assert here is not None, path
            reported = v.get("fieldPath", "")
            at = path + reported if reported.startswith(".") else path
            here.rules.append(Rule(v["rule"], v.get("message", ""), at))
        for child_path, child in _child_paths(path, node):
            visit(child_path, child, here)

    for name in ("metadata", "spec", "status"):
        visit(name, root["properties"][name], None)
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _code(value: Any) -> str:
    text = value if isinstance(value, str) and value else json.dumps(
        value, separators=(", ", ": "))
    tick = "``" if "`" in text else "`"
    pad = " " if tick == "``" else ""
    return f"{tick}{pad}{text}{pad}{tick}"


def type_of(path: str, node: Schema) -> str:
    """The field's type in words, linking to its section when it has one."""
    nullable = ", or null" if node.get("nullable") else ""
    quantity = QUANTITY_HINT in str(node.get("pattern", ""))
    if node.get("x-kubernetes-int-or-string"):
        return ("quantity (`8Gi`, `500m`, `2`)" if quantity else "integer or string") + nullable
    kind = node.get("type")
    if kind == "string" and quantity:
        return f"quantity string (`4Gi`, `512Mi`){nullable}"
    if kind == "object":
        if _has_section(node):
            return f"[object](#{anchor(path)}){nullable}"
        sub = node.get("additionalProperties")
        if isinstance(sub, dict):
            return f"map of string to {type_of(path + '{}', sub)}{nullable}"
        return f"object (free-form){nullable}"
    if kind == "array":
        items = node.get("items")
        assert isinstance(items, dict), path
        return f"list of {type_of(path + '[]', items)}{nullable}"
    return f"{kind}{nullable}"


def _field_defaults_match(node: Schema, default: Any) -> bool:
    """True when an object's default is just each of its fields' own default."""
    props = node.get("properties") or {}
    return isinstance(default, dict) and all(
        key in props and props[key].get("default") == value for key, value in default.items())


def default_of(node: Schema) -> str:
    if "default" not in node:
        return ""
    value = node["default"]
    if _has_section(node) and value and _field_defaults_match(node, value):
        return "each field's default"
    text = json.dumps(value, separators=(", ", ": "))
    if len(text) > SHORT_DEFAULT and isinstance(value, dict | list):
        return f"{len(value)} {'entries' if isinstance(value, dict) else 'items'}: {_code(text)}"
    return _code(value)


def _bound(node: Schema, key: str, exclusive_key: str, inclusive: str,
           exclusive: str) -> str | None:
    if key not in node:
        return None
    return f"{exclusive if node.get(exclusive_key) else inclusive} {node[key]}"


def constraints(node: Schema, required: bool) -> list[str]:
    out = ["Required." if required else ""]
    if "enum" in node:
        out.append("One of " + ", ".join(_code(v) for v in node["enum"]) + ".")
    bounds = [b for b in (
        _bound(node, "minimum", "exclusiveMinimum", "≥", ">"),
        _bound(node, "maximum", "exclusiveMaximum", "≤", "<")) if b]
    if bounds:
        out.append("Value " + " and ".join(bounds) + ".")
    if "minLength" in node or "maxLength" in node:
        out.append("Length " + " and ".join(
            f"{op} {node[k]}" for k, op in (("minLength", "≥"), ("maxLength", "≤"))
            if k in node) + ".")
    if "minItems" in node or "maxItems" in node:
        out.append("Items " + " and ".join(
            f"{op} {node[k]}" for k, op in (("minItems", "≥"), ("maxItems", "≤"))
            if k in node) + ".")
    if node.get("x-kubernetes-list-type") == "map":
        keys = ", ".join(_code(k) for k in node.get("x-kubernetes-list-map-keys") or [])
        out.append(f"No two items with the same {keys}.")
    elif node.get("x-kubernetes-list-type") == "set":
        out.append("No two equal items.")
    quantity = QUANTITY_HINT in str(node.get("pattern", ""))
    if "pattern" in node and not node.get("x-kubernetes-int-or-string") and not quantity:
        out.append(f"Pattern {_code(node['pattern'])}.")
    for sub_key in ("items", "additionalProperties"):
        sub = node.get(sub_key)
        if isinstance(sub, dict) and not _has_section(sub):
            inner = [c for c in constraints(sub, False) if c]
            if inner:
                what = "Each item" if sub_key == "items" else "Each value"
                out.append(f"{what}: " + " ".join(c[0].lower() + c[1:] for c in inner))
    return [c for c in out if c]


def _section_text(sec: Section) -> list[str]:
    lines = [f"### {sec.path}", ""]
    if sec.description:
        lines += [sec.description, ""]
    props = sec.node.get("properties") or {}
    required = set(sec.node.get("required") or [])
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, sub in props.items():
        path = f"{sec.path}.{name}"
        text = " ".join([str(sub.get("description", "")), *constraints(sub, name in required)])
        lines.append(f"| `{name}` | {type_of(path, sub)} | {_cell(default_of(sub))} | "
                     f"{_cell(text)} |")
    if sec.rules:
        lines += ["", "Rules the API server checks (CEL); a broken one names its field:", "",
                  "| field | rule | message |", "|---|---|---|"]
        lines += [f"| `{r.field_path}` | {_cell(_code(r.rule))} | {_cell(r.message)} |"
                  for r in sec.rules]
    return [*lines, ""]


HEADER = """\
# `MooncakeCluster` configuration reference

<!-- Generated by `mooncake-operator operator crd --reference --write` from the CRD, which
is generated from operator/mooncake_operator/spec.py. Do not edit by hand: a test fails
when this page and the CRD differ. -->

`apiVersion: {group}/{version}`, `kind: {kind}` (namespaced; short name `{short}`). Every
field the API server accepts, with its type, the default it fills in when the field is
absent, its constraints and the CEL rules checked on create and update. For what the
fields do together, with examples, see [crd.md](crd.md); `kubectl explain
mooncakecluster.spec` reads the same descriptions.

Section names are field paths; `[]` stands for each item of a list.
"""


def render(doc: dict[str, Any] | None = None) -> str:
    doc = doc if doc is not None else crdmod.crd()
    version = doc["spec"]["versions"][0]
    names = doc["spec"]["names"]
    root = version["schema"]["openAPIV3Schema"]
    secs = sections(root)
    anchors = [anchor(s.path) for s in secs]
    duplicated = {a for a in anchors if anchors.count(a) > 1}
    if duplicated:
        raise ValueError(f"sections with the same anchor: {sorted(duplicated)}")
    lines = [HEADER.format(group=doc["spec"]["group"], version=version["name"],
                           kind=names["kind"], short=names["shortNames"][0])]
    lines += ["`kubectl get mcc` shows:", "", "| column | from | meaning |", "|---|---|---|"]
    lines += [f"| {c['name']} | `{_cell(c['jsonPath'])}` | {_cell(c.get('description', ''))} |"
              for c in version.get("additionalPrinterColumns", [])]
    lines += ["", "## Contents", ""]
    for sec in secs:
        depth = sec.path.count(".")
        lines.append(f"{'  ' * depth}- [{sec.path}](#{anchor(sec.path)})")
    lines.append("")
    for part, title in (("metadata", "Metadata"), ("spec", "Spec: what you ask for"),
                        ("status", "Status: what the operator reports")):
        lines += [f"## {title}", ""]
        for sec in secs:
            if sec.path == part or sec.path.startswith((part + ".", part + "[")):
                lines += _section_text(sec)
    return "\n".join(lines).rstrip("\n") + "\n"


def default_path() -> Path:
    """``docs/reference.md`` of the source checkout this module runs from."""
    return Path(__file__).resolve().parents[2] / REFERENCE_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="render the configuration reference")
    parser.add_argument("--write", action="store_true", help=f"write {REFERENCE_FILE}")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the committed page differs")
    parser.add_argument("--path", type=Path, default=None)
    args = parser.parse_args(argv)
    path = args.path or default_path()
    text = render()
    if args.write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
        return 0
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            print(f"{path} is out of date: run "
                  "`mooncake-operator operator crd --reference --write`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
