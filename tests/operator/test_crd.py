"""The CRD is generated from the spec models: committed file in sync, structural, every
field described, defaults and CEL rules where the API server needs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from mooncake_operator import crd
from mooncake_operator.spec import MooncakeClusterSpec

ROOT = Path(__file__).resolve().parents[2]


def _schema() -> dict[str, Any]:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in (node.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_committed_crd_matches_the_models() -> None:
    committed = (ROOT / crd.CRD_DIR / crd.CRD_FILE).read_text(encoding="utf-8")
    assert committed == crd.render(), "run `mooncake-operator operator crd --write`"


def _undescribed(part: str) -> list[str]:
    return [p for p, node in _walk(_schema()["properties"][part], part)
            if "." in p and not p.endswith(("[]", "{}")) and not node.get("description")]


def test_every_field_has_a_description() -> None:
    assert _undescribed("spec") == []
    assert _undescribed("status") == []


def test_structural() -> None:
    """No $ref, titles or nulls; anyOf only in the int-or-string form."""
    for p, node in _walk(_schema()):
        assert "$ref" not in node and "title" not in node, p
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, p
            assert all(set(x) == {"type"} for x in node["anyOf"]), p
        if node.get("type") == "object":
            assert ("properties" in node or "additionalProperties" in node
                    or node.get("x-kubernetes-preserve-unknown-fields")), p


def test_nested_defaults_are_whole_objects() -> None:
    """The API server checks CEL rules against defaults, so nested defaults are complete."""
    spec = _schema()["properties"]["spec"]["properties"]
    engine = spec["engine"]["default"]
    assert engine["ports"] == {"http": 8000, "kvEvents": 5557, "kvReplay": 5558,
                               "engineHttp": 8100}
    assert spec["store"]["default"]["segmentSize"] == "4Gi"
    # and they parse back into the model
    MooncakeClusterSpec.model_validate({"model": {"name": "m"}, **{
        k: v["default"] for k, v in spec.items() if "default" in v}})


def test_api_surface() -> None:
    doc = crd.crd()
    assert doc["metadata"]["name"] == "mooncakeclusters.mooncake.io"
    names = doc["spec"]["names"]
    assert (names["kind"], names["shortNames"]) == ("MooncakeCluster", ["mcc"])
    version = doc["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}  # no scale: two pools, one writer each
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    assert cols == ["Ready", "Prefill", "Decode", "Store", "Policy", "Revision", "Age"]
    rules = [r for _p, node in _walk(_schema())
             for r in node.get("x-kubernetes-validations") or []]
    assert len(rules) >= 8 and all(r.get("message") and r.get("rule") for r in rules)
    assert all(r.get("fieldPath", "").startswith(".") for r in rules)


def test_policy_enum_is_the_registry() -> None:
    from mooncake_conductor.policies.registry import policy_names

    policy = _schema()["properties"]["spec"]["properties"]["conductor"]["properties"]["policy"]
    assert policy["enum"] == policy_names()


def test_render_is_yaml_of_the_object() -> None:
    assert yaml.safe_load(crd.render()) == crd.crd()


def test_the_owned_flags_regex_matches_each_flag_and_nothing_else() -> None:
    import re

    from mooncake_operator.spec import OWNED_FLAGS, owned_flags_regex

    rx = re.compile(owned_flags_regex(OWNED_FLAGS))
    for flag in OWNED_FLAGS:
        assert rx.match(flag) and rx.match(flag + "=1"), flag
        assert not rx.match(flag + "x") and not rx.match(flag + "-x"), flag
        assert not rx.match(" " + flag) and not rx.match(flag.removeprefix("-")), flag
    for other in ("--model-name", "--hostname", "--tp-size", "--kv-cache-dtype", "--store-x",
                  "--disaggregation-ib-device", "--gpu-memory-utilization=0.9", "-p", ""):
        assert not rx.match(other), other
